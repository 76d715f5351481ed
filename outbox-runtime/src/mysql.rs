//! The outbox on MySQL 8 and MariaDB 10.6+ (feature `mysql`): the unit of work on
//! diesel-async's [`AsyncMysqlConnection`] and a message relay that publishes its rows.
//!
//! [`Outbox::transaction`](crate::Outbox::transaction) takes an `AsyncMysqlConnection` (or a
//! deadpool guard of one) as it takes a PostgreSQL one: the same closure, the same
//! [`UnitOfWork`](crate::UnitOfWork). The tables are this module's [`MIGRATIONS`]
//! (`outbox-runtime/migrations-mysql/`), the same columns in MySQL's types; run them with
//! [`run_migrations`]. [`MysqlRelay`] publishes the rows to JetStream with the same subjects,
//! headers and `Nats-Msg-Id` as the PostgreSQL relay.
//!
//! ```no_run
//! use outbox_runtime::{DomainEvent, Outbox, PendingEvents, UnitOfWorkError, aggregate};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Serialize, Deserialize, DomainEvent)]
//! enum OrderEvent { Placed { customer: String } }
//!
//! #[aggregate]
//! struct Order { id: String, pending_events: PendingEvents<OrderEvent> }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let url = "mysql://root@127.0.0.1:3306/test";
//! outbox_runtime::mysql::run_migrations(url).await?;
//! // diesel-async's `AsyncMysqlConnection::establish`, and `ssl_ca=<PEM file>` for TLS.
//! let mut conn = outbox_runtime::mysql::establish(url).await?;
//! let mut order = Order { id: "o-1".into(), pending_events: PendingEvents::new() };
//! order.record(OrderEvent::Placed { customer: "ada".into() });
//! Outbox::new()
//!     .transaction(&mut conn, async |uow| {
//!         uow.track(&mut order);
//!         Ok::<_, UnitOfWorkError>(())
//!     })
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Guarantees, and how they differ from PostgreSQL's
//! - Events commit with the business rows or not at all; per-aggregate sequences are
//!   contiguous and in commit order (the unit of work locks the aggregate's
//!   `outbox_aggregates` row, as on PostgreSQL); dedup keys take a primary key of their own.
//! - The relay claims only the head of each aggregate's queue with `FOR UPDATE SKIP LOCKED`
//!   (MySQL 8.0.1, MariaDB 10.6), so several relays keep each aggregate in order; a rejected
//!   row is retried with backoff and dead-lettered after the retry policy's attempts, its
//!   aggregate's later rows parked behind it.
//! - No LISTEN/NOTIFY: a relay polls every [`RelayConfig::poll_interval`], and is woken at
//!   once by a unit of work that commits in the same process. A row committed by another
//!   process waits up to one poll interval (500 ms by default): lower it for latency, at the
//!   cost of one claim query per interval per worker when idle.
//! - A relay whose host vanished mid-batch (no FIN, no RST) holds its claimed heads until the
//!   server closes its session: the relay's sessions set `wait_timeout` to twice
//!   `poll_interval` plus 20 s (21 s with the defaults; the server's default is 8 hours), and
//!   a batch that publishes for longer sends its session a statement every third of that.
//!   PostgreSQL's sessions use TCP keepalives instead (about 25 s).
//! - Dead letters: [`crate::dead_letter`]'s functions take an [`AsyncMysqlConnection`]; a
//!   retry or skip wakes the relays of its own process at once, others at their next poll.
//!   So do the `outbox` command's `dead-letters`, `retry` and `skip`, beside `migrate`,
//!   `relay` and `status` (built with `--features mysql`).
//! - The archive ([`PublishedRows::Archive`]): the relay moves each acked row, whole, into
//!   `outbox_published` in its batch's transaction, so `outbox_events` keeps only what is
//!   queued (MySQL has no partial index, so with [`PublishedRows::Mark`] the claim steps over
//!   the published rows kept beside the queue; the archive keeps them elsewhere). One table,
//!   clustered by `published_at`; PostgreSQL's is partitioned by day.
//! - Retention: [`crate::outbox::purge_published`] (for [`PublishedRows::Mark`], through the
//!   claim's index on `available_at`), [`purge_archived`] (for [`PublishedRows::Archive`])
//!   and [`crate::outbox::purge_dedup_keys`] take an [`AsyncMysqlConnection`]; so do
//!   `outbox purge` and `outbox relay --purge-older-than`.
//! - The inbox: [`Inbox<H, AsyncMysqlConnection>`](crate::Inbox) with a
//!   [`Handler<AsyncMysqlConnection>`](crate::Handler), on the tables of migration
//!   `2026-11-27-000004_inbox`, with the same guarantees as on PostgreSQL: effects once per
//!   message, each aggregate's events in order across restarts and instances, dead letters.
//!   Its sessions set `wait_timeout` to `handler_timeout` plus `statement_timeout` (at least
//!   60 s; 5.5 min with the defaults), so that a handler may work that long without a
//!   statement on its connection and still commit, and an instance whose host vanished
//!   mid-message gives its aggregate's position back then (PostgreSQL's sessions: TCP
//!   keepalives, within about 25 s); a shorter `handler_timeout` gives it back sooner. The
//!   inbox's own queries are bounded by `statement_timeout` on the client; the handlers' are
//!   not (no server-side equivalent covers every statement on both servers).
//! - Accounts of their own: [`privileges::mysql_grants`](crate::privileges::mysql_grants)
//!   (`outbox grants <component> <account> --mysql <database>`) writes what each part needs;
//!   the relay and the inbox check at connect that their account holds it, and name each
//!   privilege it lacks.
//! - Not on MySQL: the topology registry.
//! - The relay reads the outbox lag and the counts of waiting rows into the same gauges as on
//!   PostgreSQL ([`stats`] reads them on demand).
//! - A COMMIT or ROLLBACK sent by hand inside the closure, or a DDL statement (which MySQL
//!   commits implicitly), ends the unit of work's transaction: the unit of work sees that its
//!   savepoint is gone before it writes the events, writes none, and fails with
//!   [`UnitOfWorkError::TransactionEnded`].
//! - Tested on MariaDB 10.11; the SQL keeps to what MySQL 8.0.16+ also has.
//!
//! [`RelayConfig::poll_interval`]: crate::RelayConfig::poll_interval
//! [`PublishedRows::Archive`]: crate::PublishedRows::Archive
//! [`PublishedRows::Mark`]: crate::PublishedRows::Mark

use std::collections::{HashMap, HashSet};

use diesel::QueryableByName;
use diesel::mysql::Mysql;
use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
use diesel::sql_types::{BigInt, Nullable, Text};
pub use diesel_async::AsyncMysqlConnection;
use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_async::{AnsiTransactionManager, RunQueryDsl};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use crate::causality::Causality;
use crate::outbox::queries::{DedupKeys, NewEvent, TakenKey, numbering};
use crate::outbox::{MigrationError, MissingMigrations, Outbox, TablesElsewhere};
use crate::unit_of_work::{DuplicateEvents, UnitOfWorkError, drop_duplicates};

pub use crate::relay::mysql::{MysqlRelay, stats};

/// The outbox's migrations for MySQL and MariaDB (`outbox-runtime/migrations-mysql/`), for
/// [`run_migrations`] or your own diesel migration harness.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations-mysql");

/// The name of the lock ([`GET_LOCK`]) that serialises concurrent migration runs.
///
/// [`GET_LOCK`]: https://dev.mysql.com/doc/refman/8.0/en/locking-functions.html
const MIGRATION_LOCK: &str = "outbox-migrations";

mod defaults;

/// Opens a connection to `database_url` as diesel-async's `AsyncMysqlConnection::establish`
/// does (mysql_async's URL options), and reads the URL as diesel's own `MysqlConnection`
/// (libmysqlclient) reads it too: without a host, `localhost`; without a port, user or
/// password, `MYSQL_TCP_PORT`, the operating system's user and `MYSQL_PWD`; diesel's
/// `unix_socket=<path>` and `ssl_mode=<disabled|preferred|required|verify_ca|verify_identity>`
/// (the module `defaults` of this one has the rules). Where mysql_async alone refused
/// `mysql:///orders` and those options, and logged in as the user `''`, a URL a service's
/// diesel connections take connects the toolkit's as well. It takes three options more,
/// named as diesel's own `MysqlConnection` and MySQL's client name them:
///
/// - `ssl_ca=<PEM file>`: the certificate authorities that sign the server's certificate (a
///   private authority's, or a cloud's bundle: Amazon RDS's certificates chain to
///   "rds-ca-rsa2048-g1" and its kin, which no public store holds; AWS docs, "Using SSL/TLS
///   to encrypt a connection to a DB instance"). The server's certificate must chain to one
///   of them, and to no other authority; its name is checked against the host, whatever
///   `verify_identity=false` (or `ssl_mode=verify_ca`) says: the driver's way to skip it is
///   inert on rustls (mysql_async issue 404), and the error of a wrong name says so. Without
///   it, the server's certificate is checked against the public authorities (webpki's
///   roots), or `verify_ca=false` (or `ssl_mode=required`) takes any certificate.
/// - `ssl_cert=<PEM file>` and `ssl_key=<PEM file>`, together: a client certificate (its
///   chain) and its private key, for an account created `REQUIRE X509` or `REQUIRE SUBJECT`
///   (MySQL 8.0 docs, 15.7.1.3 "CREATE USER Statement", "SSL/TLS Options"), as Google Cloud
///   SQL and Azure ask. The key must be RSA, in PKCS#1 (`BEGIN RSA PRIVATE KEY`) or PKCS#8
///   (`BEGIN PRIVATE KEY`) form: the driver (mysql_async on rustls) signs with RSA keys only,
///   so an EC or Ed25519 key is refused, naming its kind.
///
/// With any of them the connection is TLS (as `require_ssl=true`). The files are read before
/// connecting, and one that is missing or holds no certificate or key is named with its fault,
/// never its content. The session commits each statement run outside a transaction, whatever
/// the server's `autocommit` default, and words its errors in English, whatever the server's
/// `lc_messages` (`SET SESSION autocommit = 1, lc_messages = 'en_US'`). The relays, the
/// inbox (its handlers' connection too), [`run_migrations`] and the `outbox` command open
/// their connections with it.
///
/// ```no_run
/// # async fn run() -> Result<(), diesel::ConnectionError> {
/// let conn = outbox_runtime::mysql::establish(
///     "mysql://app:secret@db.internal:3306/orders?ssl_ca=/etc/ssl/rds-global-bundle.pem",
/// )
/// .await?;
/// let conn = outbox_runtime::mysql::establish(
///     "mysql://app@10.0.0.5:3306/orders?ssl_ca=/etc/mysql/server-ca.pem\
///      &ssl_cert=/etc/mysql/client-cert.pem&ssl_key=/etc/mysql/client-key.pem",
/// )
/// .await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`InvalidConnectionUrl`](diesel::ConnectionError::InvalidConnectionUrl) for a URL that
/// does not parse or names no database (`mysql://host:3306` and `mysql://host:3306/`: a
/// session without one fails every statement on the outbox's tables), a `ssl_mode` that is
/// not one of MySQL's or contradicts another option, a `MYSQL_TCP_PORT` that is not a port
/// number, an `ssl_ca`,
/// `ssl_cert` or `ssl_key` that names no file or holds no certificate or key, an `ssl_cert`
/// without its `ssl_key` (or the reverse), and a key that is not RSA; else the driver's
/// error, as `establish`'s, with what was taken from the environment where anything was
/// ("(from the environment: MYSQL_TCP_PORT=3307, MYSQL_PWD; no host in the URL: localhost,
/// as libmysqlclient)", never the password).
pub async fn establish(database_url: &str) -> diesel::ConnectionResult<AsyncMysqlConnection> {
    if !names_a_database(database_url) {
        return Err(diesel::ConnectionError::InvalidConnectionUrl(
            "the URL names no database, where the outbox's tables are: \
             mysql://user@host:3306/<database>"
                .to_owned(),
        ));
    }
    let mut conn = connect(database_url).await?;
    diesel_async::SimpleAsyncConnection::batch_execute(&mut conn, SESSION)
        .await
        .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
    Ok(conn)
}

/// The settings of a session of [`establish`]'s, whatever the server's defaults:
///
/// - `autocommit = 1`: each statement run outside a transaction commits, as diesel takes it
///   to (its transaction manager opens and ends the transactions; a statement outside one is
///   taken as committed). Under an operator's `autocommit = 0` (MySQL docs, "autocommit,
///   Commit, and Rollback"), a session's first statement opened a transaction that nothing
///   ended, whose writes were lost when the session closed (an `outbox purge`'s deletes, a
///   migration's record) and whose metadata locks held up every DDL on its tables (a
///   migration, a `DROP DATABASE`) while it lived.
/// - `lc_messages = 'en_US'`: errors in English, the language of the server's error-message
///   files that the toolkit's hints read (a missing privilege's "command denied to user", a
///   replica's "--read-only option"; diesel keeps a server error's words, not its number).
///   Under an operator's `lc_messages = 'de_DE'` (MySQL docs, "Setting the Error Message
///   Language"), a privilege revoked under a running relay or inbox was logged in German
///   alone, without what to run. Any account may set it for its session.
const SESSION: &str = "SET SESSION autocommit = 1, lc_messages = 'en_US'";

/// Whether the MySQL URL `database_url` names a database: a path after its host, as
/// `mysql://user@host:3306/orders`. Without one the session has no default database, and
/// every statement on the outbox's tables fails ("No database selected").
fn names_a_database(database_url: &str) -> bool {
    let rest = database_url
        .split_once("://")
        .map_or(database_url, |(_, rest)| rest);
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    rest.split_once('/')
        .is_some_and(|(_, database)| !database.is_empty())
}

/// The connection of [`establish`], before its settings: the URL read as diesel's
/// `MysqlConnection` reads it ([`defaults`]), and the error of a connection that fails with
/// what it took from the environment.
async fn connect(database_url: &str) -> diesel::ConnectionResult<AsyncMysqlConnection> {
    use diesel::ConnectionError;
    let completed =
        defaults::complete(database_url).map_err(ConnectionError::InvalidConnectionUrl)?;
    let connected = connect_to(&completed.url)
        .await
        .map_err(|error| match error {
            ConnectionError::BadConnection(error)
                if error.contains("certificate not valid for name")
                    && completed.url.contains("verify_identity=false") =>
            {
                ConnectionError::BadConnection(format!(
                    "{error} (the name is checked whatever verify_identity=false and \
                     ssl_mode=verify_ca say: the driver, mysql_async 0.36 on rustls, fails to \
                     tell a wrong name from another fault, mysql_async issue 404; connect by \
                     a name the certificate holds)"
                ))
            }
            error => error,
        });
    match (connected, completed.taken) {
        (Err(ConnectionError::BadConnection(error)), Some(taken)) => {
            Err(ConnectionError::BadConnection(format!("{error} ({taken})")))
        }
        (Err(ConnectionError::InvalidConnectionUrl(error)), Some(taken)) => Err(
            ConnectionError::InvalidConnectionUrl(format!("{error} ({taken})")),
        ),
        (connected, _) => connected,
    }
}

/// [`connect`] to a URL in mysql_async's terms, with the TLS files it names. The driver is
/// given options, never the URL: diesel-async's `establish` would hand the URL, with the
/// password [`defaults`] may have put in it (`MYSQL_PWD`), to the service's diesel
/// instrumentation (its `StartEstablishConnection` event).
async fn connect_to(database_url: &str) -> diesel::ConnectionResult<AsyncMysqlConnection> {
    use diesel::ConnectionError;
    let (url, files) = match tls_files(database_url)? {
        Some((url, files)) => (url, Some(files)),
        None => (database_url.to_owned(), None),
    };
    let opts = mysql_async::Opts::from_url(&url)
        .map_err(|e| ConnectionError::InvalidConnectionUrl(e.to_string()))?;
    let mut builder = mysql_async::OptsBuilder::from_opts(opts.clone());
    if let Some(files) = files {
        // `require_ssl=true` is in `url`.
        let mut tls = opts.ssl_opts().cloned().unwrap_or_default();
        if let Some(authorities) = files.authorities {
            tls = tls
                .with_root_certs(vec![authorities.into()])
                .with_disable_built_in_roots(true);
        }
        if let Some((chain, key)) = files.identity {
            tls = tls.with_client_identity(Some(mysql_async::ClientIdentity::new(
                chain.into(),
                key.into(),
            )));
        }
        builder = builder.ssl_opts(Some(tls));
    }
    // As diesel-async's `establish` sets them: its own statement cache, and affected rows
    // counted as matched rows, as PostgreSQL counts them. It runs its session's settings
    // (UTC, utf8mb4) in `try_from`.
    let builder = builder.stmt_cache_size(0).client_found_rows(true);
    let conn = mysql_async::Conn::new(builder)
        .await
        .map_err(|e| ConnectionError::BadConnection(e.to_string()))?;
    AsyncMysqlConnection::try_from(conn).await
}

/// The TLS files a URL names beyond mysql_async's own options.
#[derive(Debug, Default)]
struct TlsFiles {
    /// `ssl_ca`.
    authorities: Option<std::path::PathBuf>,
    /// `ssl_cert`, and `ssl_key`'s RSA key in PKCS#1 DER, the one form the driver reads of
    /// every RSA key.
    identity: Option<(std::path::PathBuf, Vec<u8>)>,
}

/// `database_url` without its `ssl_ca`, `ssl_cert` and `ssl_key` options and with
/// `require_ssl=true` in place of any `require_ssl` (mysql_async applies `verify_identity`,
/// `verify_ca` and `built_in_roots` only with it), and the files they name, read and checked;
/// `None` without any of them.
///
/// # Errors
/// As [`establish`]'s, for the files.
fn tls_files(database_url: &str) -> diesel::ConnectionResult<Option<(String, TlsFiles)>> {
    use diesel::ConnectionError::InvalidConnectionUrl;
    let Some((base, query)) = database_url.split_once('?') else {
        return Ok(None);
    };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (query, None),
    };
    let (mut authorities, mut chain, mut key) = (None, None, None);
    let mut kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let Some((name, value)) = pair.split_once('=') else {
                return true;
            };
            let path = || {
                let value = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
                Some(std::path::PathBuf::from(value.as_ref()))
            };
            match name {
                "ssl_ca" => authorities = path(),
                "ssl_cert" => chain = path(),
                "ssl_key" => key = path(),
                "require_ssl" => {}
                _ => return true,
            }
            false
        })
        .collect();
    if authorities.is_none() && chain.is_none() && key.is_none() {
        return Ok(None);
    }
    kept.push("require_ssl=true");
    for (option, path) in [
        ("ssl_ca", &authorities),
        ("ssl_cert", &chain),
        ("ssl_key", &key),
    ] {
        if let Some(path) = path.as_ref().filter(|path| !path.is_file()) {
            return Err(InvalidConnectionUrl(format!(
                "{option} {}: no such file",
                path.display()
            )));
        }
    }
    let identity = match (chain, key) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(InvalidConnectionUrl(
                "ssl_cert needs ssl_key beside it: the client certificate's private key".into(),
            ));
        }
        (None, Some(_)) => {
            return Err(InvalidConnectionUrl(
                "ssl_key needs ssl_cert beside it: the client certificate it is the key of".into(),
            ));
        }
        (Some(chain), Some(key)) => {
            use rustls_pki_types::CertificateDer;
            use rustls_pki_types::pem::PemObject;
            if CertificateDer::pem_file_iter(&chain)
                .ok()
                .and_then(|mut certificates| certificates.next())
                .is_none_or(|first| first.is_err())
            {
                return Err(InvalidConnectionUrl(format!(
                    "ssl_cert {}: no certificate in it (a PEM file: BEGIN CERTIFICATE)",
                    chain.display()
                )));
            }
            let pkcs1 = rsa_key(&key).map_err(|fault| {
                InvalidConnectionUrl(format!("ssl_key {}: {fault}", key.display()))
            })?;
            Some((chain, pkcs1))
        }
    };
    let mut url = format!("{base}?{}", kept.join("&"));
    if let Some(fragment) = fragment {
        url.push('#');
        url.push_str(fragment);
    }
    Ok(Some((
        url,
        TlsFiles {
            authorities,
            identity,
        },
    )))
}

/// The first private key of the PEM file at `path`, as PKCS#1 DER: as it is when it is
/// PKCS#1 (`BEGIN RSA PRIVATE KEY`), taken out of its PKCS#8 wrapping (`BEGIN PRIVATE KEY`,
/// RFC 5208, 5) when that holds an RSA key (`rsaEncryption`, RFC 8017, A.1); else why not,
/// never the key.
fn rsa_key(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use rustls_pki_types::PrivateKeyDer;
    use rustls_pki_types::pem::PemObject;
    /// rsaEncryption (RFC 8017, A.1).
    const RSA_ENCRYPTION: pkcs8::ObjectIdentifier =
        pkcs8::ObjectIdentifier::new_unwrap("1.2.840.113549.1.1.1");
    let not_rsa = "the driver (mysql_async on rustls) signs with RSA keys only; give a client \
                   certificate whose key is RSA";
    match PrivateKeyDer::from_pem_file(path) {
        Ok(PrivateKeyDer::Pkcs1(key)) => Ok(key.secret_pkcs1_der().to_vec()),
        Ok(PrivateKeyDer::Pkcs8(key)) => {
            let info = pkcs8::PrivateKeyInfo::try_from(key.secret_pkcs8_der())
                .map_err(|_| "its PKCS#8 key (BEGIN PRIVATE KEY) does not parse".to_owned())?;
            if info.algorithm.oid == RSA_ENCRYPTION {
                Ok(info.private_key.to_vec())
            } else {
                Err(format!(
                    "a PKCS#8 key of algorithm {} (not RSA: EC is 1.2.840.10045.2.1, Ed25519 \
                     1.3.101.112); {not_rsa}",
                    info.algorithm.oid
                ))
            }
        }
        Ok(PrivateKeyDer::Sec1(_)) => Err(format!("an EC key (BEGIN EC PRIVATE KEY); {not_rsa}")),
        Ok(_) => Err(format!("a key of a kind not known here; {not_rsa}")),
        Err(_) => Err(
            "no private key in it (a PEM file: BEGIN RSA PRIVATE KEY or BEGIN PRIVATE KEY; an \
             encrypted key is not read)"
                .to_owned(),
        ),
    }
}

/// Applies the pending [`MIGRATIONS`] to the database at `database_url`
/// (`mysql://user:password@host:port/database`) and returns the versions it applied (empty
/// when the schema is current).
///
/// Safe to call from every instance at start-up: a named lock (`GET_LOCK`) serialises
/// concurrent runs. Runs on a blocking thread. MySQL commits DDL as it goes, so a migration
/// that fails half-way leaves what it created; the migrations here each create tables only.
/// The connection is opened as [`establish`] opens it, within
/// [`DEFAULT_CONNECT_TIMEOUT`](crate::database::DEFAULT_CONNECT_TIMEOUT) (10 s).
///
/// # Errors
/// [`MigrationError::Connect`] naming the server (without its password) when it cannot be
/// reached in time, refuses the account, or the URL names no database;
/// [`MigrationError::UnsupportedServer`] on MySQL before 8.0.16 or MariaDB before 10.6, with
/// nothing applied; [`MigrationError::ReadOnly`] on a server that takes no writes (a
/// replica's `read_only`); else [`MigrationError`] naming the step that failed.
pub async fn run_migrations(database_url: &str) -> Result<Vec<String>, MigrationError> {
    let connection = crate::database::within_connect_timeout(
        database_url,
        crate::database::DEFAULT_CONNECT_TIMEOUT,
        async { establish(database_url).await.map_err(|e| e.to_string()) },
    )
    .await?;
    tokio::task::spawn_blocking(move || {
        use diesel::connection::SimpleConnection as _;
        let mut connection = AsyncConnectionWrapper::<AsyncMysqlConnection>::from(connection);
        #[derive(QueryableByName)]
        struct Server {
            #[diesel(sql_type = Text)]
            version: String,
        }
        let server: Server = diesel::RunQueryDsl::get_result(
            diesel::sql_query("SELECT VERSION() AS version"),
            &mut connection,
        )
        .map_err(|e| MigrationError::Migration(Box::new(e)))?;
        if older_than_supported(&server.version) {
            return Err(MigrationError::UnsupportedServer {
                server: server.version,
                minimum: MINIMUM_SERVERS,
            });
        }
        // Waits as long as another instance migrates; released when the connection closes
        // even if a migration fails.
        connection.batch_execute(&format!("DO GET_LOCK('{MIGRATION_LOCK}', -1)"))?;
        let applied = connection
            .run_pending_migrations(MIGRATIONS)
            .map_err(|e| MigrationError::applying(e, crate::database::Kind::Mysql))?
            .into_iter()
            .map(|version| version.to_string())
            .collect();
        connection.batch_execute(&format!("DO RELEASE_LOCK('{MIGRATION_LOCK}')"))?;
        Ok(applied)
    })
    .await?
}

/// The oldest servers the outbox runs on, as [`MigrationError::UnsupportedServer`] names them:
/// the relay's claim takes `FOR UPDATE SKIP LOCKED` (MySQL 8.0.1, MariaDB 10.6), and the
/// tables' `CHECK` constraints refuse rows the relay could not read (enforced by MySQL since
/// 8.0.16: MySQL 8.0 Reference Manual, "CHECK Constraints").
const MINIMUM_SERVERS: &str = "MySQL 8.0.16 or later, or MariaDB 10.6 or later";

/// Whether `version`, as `VERSION()` gives it (`8.0.36`, `8.0.28-log`,
/// `10.11.6-MariaDB-0+deb12u1`), is a server older than [`MINIMUM_SERVERS`]. A version that
/// does not parse, or of another server that speaks MySQL's protocol (`8.0.11-TiDB-v7.5.0`,
/// whose own version is not MySQL's), is let through.
fn older_than_supported(version: &str) -> bool {
    let (numbers, suffix) = version.split_once('-').unwrap_or((version, ""));
    let Ok(parts) = numbers
        .split('.')
        .map(str::parse::<u32>)
        .collect::<Result<Vec<_>, _>>()
    else {
        return false;
    };
    let [major, minor, patch] = parts[..] else {
        return false;
    };
    if suffix.contains("MariaDB") {
        (major, minor) < (10, 6)
    } else if suffix.contains("TiDB") {
        false
    } else {
        (major, minor, patch) < (8, 0, 16)
    }
}

/// The versions of [`MIGRATIONS`] the database at the other end of `conn` has not applied,
/// oldest first: empty when the outbox schema is current.
///
/// # Errors
/// The database's error.
pub async fn pending_migrations(
    conn: &mut AsyncMysqlConnection,
) -> diesel::QueryResult<Vec<String>> {
    pending_versions(conn).await
}

/// Deletes the archived rows ([`PublishedRows::Archive`]: `outbox_published`) published
/// more than `older_than` ago, oldest first, `batch` rows per statement (at least 1), each its
/// own short transaction, and returns how many; `progress` hears the running total after each
/// batch. Each batch reads only the rows it deletes (the archive is clustered by
/// `published_at`). An `older_than` over a thousand years (`Duration::MAX`, say) deletes
/// nothing. The `outbox` command runs it in `purge` and `relay --purge-older-than`.
///
/// PostgreSQL's archive is partitioned by day and dropped a day at a time
/// ([`drop_archived`](crate::outbox::drop_archived)); MySQL's is one table, deleted row by
/// row.
///
/// # Errors
/// The database's error; the batches before it stay deleted.
///
/// [`PublishedRows::Archive`]: crate::PublishedRows::Archive
pub async fn purge_archived(
    conn: &mut AsyncMysqlConnection,
    older_than: std::time::Duration,
    batch: i64,
    mut progress: impl FnMut(usize) + Send,
) -> diesel::QueryResult<usize> {
    crate::outbox::purge::mysql::purge_archived(conn, older_than, batch.max(1), &mut progress).await
}

/// The tables [`MIGRATIONS`] make, as a list of SQL strings.
const OUTBOX_TABLES: &str = "'outbox_events', 'outbox_aggregates', 'outbox_dedup_keys', \
    'outbox_published', 'outbox_inbox', 'outbox_inbox_positions', 'outbox_inbox_attempts', \
    'outbox_inbox_gaps', 'outbox_inbox_dead_letters'";

/// [`pending_migrations`] on either connection.
///
/// MySQL's `information_schema` shows an account only the tables it holds a privilege on
/// (MySQL 8.0 docs, 28.1 "Introduction" to INFORMATION_SCHEMA), so `__diesel_schema_migrations`
/// missing there is not taken for a database never migrated while the account sees a table
/// the migrations make ([`OUTBOX_TABLES`]): then the account may not read it, and the
/// server's refusal of `SELECT` on it is returned ("SELECT command denied to user ..."), where
/// every migration would be called missing and `outbox migrate` would be asked for.
pub(crate) async fn pending_versions<C: Exec>(conn: &mut C) -> diesel::QueryResult<Vec<String>> {
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
        #[diesel(sql_type = BigInt)]
        outbox: i64,
    }
    #[derive(QueryableByName)]
    struct Version {
        #[diesel(sql_type = Text)]
        version: String,
    }
    let embedded: Vec<String> =
        diesel::migration::MigrationSource::<Mysql>::migrations(&MIGRATIONS)
            .map_err(diesel::result::Error::QueryBuilderError)?
            .iter()
            .map(|migration| migration.name().version().to_string())
            .collect();
    let tables: Vec<Count> = conn
        .load(
            diesel::sql_query(format!(
                "SELECT CAST(COUNT(CASE WHEN table_name = '__diesel_schema_migrations' \
                                   THEN 1 END) AS SIGNED) AS n, \
                        CAST(COUNT(CASE WHEN table_name IN ({OUTBOX_TABLES}) \
                                   THEN 1 END) AS SIGNED) AS outbox \
                 FROM information_schema.tables WHERE table_schema = DATABASE()",
            ))
            .into_boxed(),
        )
        .await?;
    match <[Count]>::first(&tables) {
        Some(Count { n: 0, outbox: 0 }) | None => return Ok(embedded),
        // Read it all the same: the server says why not.
        Some(_) => {}
    }
    let applied: HashSet<String> = conn
        .load::<Version>(
            diesel::sql_query("SELECT version FROM __diesel_schema_migrations").into_boxed(),
        )
        .await?
        .into_iter()
        .map(|v| v.version)
        .collect();
    Ok(embedded
        .into_iter()
        .filter(|version| !applied.contains(version))
        .collect())
}

/// The [`MIGRATIONS`] the database at the other end of `conn` lacks, as the relay, the inbox
/// and a unit of work report them: [`pending_migrations`], and where the database holds no
/// outbox tables, the server's other databases that hold them
/// ([`MissingMigrations::elsewhere`]). `None` when the outbox schema is current.
///
/// # Errors
/// The database's error.
pub async fn missing_migrations(
    conn: &mut AsyncMysqlConnection,
) -> diesel::QueryResult<Option<MissingMigrations>> {
    missing(conn).await
}

/// [`missing_migrations`] on either connection.
pub(crate) async fn missing<C: Exec>(
    conn: &mut C,
) -> diesel::QueryResult<Option<MissingMigrations>> {
    #[derive(QueryableByName)]
    struct Holder {
        #[diesel(sql_type = Nullable<Text>)]
        here: Option<String>,
        #[diesel(sql_type = Text)]
        holder: String,
    }
    let pending = pending_versions(conn).await?;
    if pending.is_empty() {
        return Ok(None);
    }
    let holders: Vec<Holder> = conn
        .load(
            diesel::sql_query(
                "SELECT DATABASE() AS here, CAST(table_schema AS CHAR) AS holder \
                 FROM information_schema.tables \
                 WHERE table_name = 'outbox_events' AND table_schema <> COALESCE(DATABASE(), '') \
                   AND NOT EXISTS (SELECT 1 FROM information_schema.tables \
                                   WHERE table_name = 'outbox_events' \
                                     AND table_schema = DATABASE()) \
                 ORDER BY table_schema",
            )
            .into_boxed(),
        )
        .await?;
    let database = <[Holder]>::first(&holders).map(|row| row.here.clone().unwrap_or_default());
    Ok(Some(MissingMigrations {
        pending,
        elsewhere: database.map(|database| TablesElsewhere::Databases {
            databases: holders.into_iter().map(|row| row.holder).collect(),
            database,
        }),
    }))
}

/// MariaDB's limits on a session left idle inside a transaction (MariaDB docs, "Server
/// System Variables": `idle_transaction_timeout`, `idle_readonly_transaction_timeout`,
/// `idle_write_transaction_timeout`, 10.3+, whole seconds, 0 for none), as an operator sets
/// them globally: the server closes a session idle in a transaction for longer. MySQL has
/// none of them.
pub(crate) const IDLE_TRANSACTION_TIMEOUTS: [&str; 3] = [
    "idle_transaction_timeout",
    "idle_readonly_transaction_timeout",
    "idle_write_transaction_timeout",
];

/// Each of [`IDLE_TRANSACTION_TIMEOUTS`] that the session has set, with its seconds: none on
/// MySQL, whose `SHOW VARIABLES` lists no such row.
pub(crate) async fn idle_transaction_timeouts(
    conn: &mut AsyncMysqlConnection,
) -> diesel::QueryResult<Vec<(&'static str, u64)>> {
    #[derive(QueryableByName)]
    struct Variable {
        #[diesel(sql_type = Text, column_name = "Variable_name")]
        name: String,
        #[diesel(sql_type = Text, column_name = "Value")]
        value: String,
    }
    let variables: Vec<Variable> =
        diesel::sql_query("SHOW SESSION VARIABLES LIKE 'idle%transaction_timeout'")
            .load(conn)
            .await?;
    Ok(variables
        .iter()
        .filter_map(|variable| {
            let name = IDLE_TRANSACTION_TIMEOUTS
                .into_iter()
                .find(|known| variable.name.eq_ignore_ascii_case(known))?;
            let seconds = variable.value.trim().parse::<u64>().ok()?;
            (seconds > 0).then_some((name, seconds))
        })
        .collect())
}

// The trait is crate-private in effect (see `unit_of_work::sealed`).
#[allow(private_interfaces)]
impl crate::unit_of_work::sealed::Backend for AsyncMysqlConnection {
    /// The check is [`require_unit_of_work`]'s; MySQL stops a multi-statement string at its
    /// first error (MySQL 8.0 C API, "Multiple Statement Execution Support"), so the COMMIT
    /// runs only after the mark was released.
    const CHECKED_COMMIT: Option<&'static str> =
        Some("RELEASE SAVEPOINT outbox_unit_of_work; COMMIT");
    const COMMIT: Option<&'static str> = Some("COMMIT");

    fn checked_commit_error(error: diesel::result::Error) -> UnitOfWorkError {
        mark_error(error)
    }

    /// MySQL keeps no record of a transaction's outcome to ask for later: no id.
    async fn begin_unit_of_work(
        &mut self,
        _outbox: &Outbox,
    ) -> diesel::QueryResult<Option<crate::unit_of_work::TransactionId>> {
        AnsiTransactionManager::begin_transaction_sql(self, BEGIN).await?;
        Ok(None)
    }

    async fn write_events(
        &mut self,
        events: Vec<NewEvent>,
        causality: &Causality,
        duplicates: DuplicateEvents,
    ) -> Result<(), UnitOfWorkError> {
        write_events(self, events, causality, duplicates).await
    }

    async fn missing_migrations(&mut self) -> diesel::QueryResult<Result<(), MissingMigrations>> {
        Ok(missing(self).await?.map_or(Ok(()), Err))
    }

    fn events_committed() {
        crate::commits::COMMITS.committed();
    }
}

/// How a unit of work opens its transaction: BEGIN, and the savepoint that marks the
/// transaction as the unit of work's (see [`require_unit_of_work`]), in one round trip.
pub(crate) const BEGIN: &str = "BEGIN; SAVEPOINT outbox_unit_of_work";

/// Releases [`BEGIN`]'s savepoint.
const RELEASE: &str = "RELEASE SAVEPOINT outbox_unit_of_work";

/// Fails with [`UnitOfWorkError::TransactionEnded`] when the unit of work's transaction is
/// no longer open: a COMMIT or ROLLBACK sent by hand on `uow.conn()`, or a statement that
/// commits implicitly (MySQL's DDL: `CREATE TABLE`, `ALTER TABLE`, ..., MySQL 8.0 Reference
/// Manual, 15.3.3 "Statements That Cause an Implicit Commit"). Either ends the transaction
/// and its savepoints, so releasing the mark fails with "SAVEPOINT does not exist"
/// (ER_SP_DOES_NOT_EXIST, 1305); the events must then not be written, or they would commit
/// on their own.
async fn require_unit_of_work<C: Exec>(conn: &mut C) -> Result<(), UnitOfWorkError> {
    released(conn.execute(diesel::sql_query(RELEASE).into_boxed()).await)
}

/// What releasing [`BEGIN`]'s savepoint says of the unit of work's transaction (see
/// [`mark_error`]).
pub(crate) fn released<T>(result: diesel::QueryResult<T>) -> Result<(), UnitOfWorkError> {
    result.map(drop).map_err(mark_error)
}

/// The name of [`BEGIN`]'s savepoint, the mark of a unit of work's transaction.
const MARK: &str = "outbox_unit_of_work";

/// The error of a statement that released [`BEGIN`]'s savepoint:
/// [`UnitOfWorkError::TransactionEnded`] when the savepoint does not exist
/// (ER_SP_DOES_NOT_EXIST, 1305: the transaction was ended), told by the savepoint's name
/// ([`MARK`]) in the error's message, the one part of it the server's language
/// (`lc_messages`) leaves as it is: MariaDB words it "SAVEPOINT outbox_unit_of_work does not
/// exist" in English and "... existiert nicht" in German, and diesel gives no error number.
/// No other error of releasing it (a lost connection, a killed query) names the savepoint.
pub(crate) fn mark_error(error: diesel::result::Error) -> UnitOfWorkError {
    match error {
        diesel::result::Error::DatabaseError(_, info) if info.message().contains(MARK) => {
            UnitOfWorkError::TransactionEnded
        }
        error => UnitOfWorkError::Database(error),
    }
}

/// Takes the events' dedup keys and writes the events that are not duplicates, with their
/// sequences, inside the open transaction, on either connection; first checks that the
/// transaction is still the unit of work's. Without events, sends nothing (as on
/// PostgreSQL): there is nothing to keep out of an ended transaction.
pub(crate) async fn write_events<C: Exec>(
    conn: &mut C,
    mut events: Vec<NewEvent>,
    causality: &Causality,
    duplicates: DuplicateEvents,
) -> Result<(), UnitOfWorkError> {
    if events.is_empty() {
        return Ok(());
    }
    require_unit_of_work(conn).await?;
    if events.iter().any(|e| e.dedup_key.is_some()) {
        let taken = take_dedup_keys(conn, &events)
            .await
            .map_err(UnitOfWorkError::Database)?;
        drop_duplicates(&mut events, &taken, duplicates)?;
    }
    if !events.is_empty() {
        insert_events(conn, &events, causality)
            .await
            .map_err(UnitOfWorkError::Database)?;
    }
    Ok(())
}

/// Runs the unit of work's statements on diesel-async's `AsyncMysqlConnection` or, with the
/// feature `mysql-sync`, on diesel's `MysqlConnection`: one body of statements for both (the
/// sync connection's futures are ready at their first poll).
pub(crate) trait Exec: Send {
    /// Executes `query`; the number of rows it affected.
    fn execute(
        &mut self,
        query: BoxedSqlQuery<'_, Mysql, SqlQuery>,
    ) -> impl Future<Output = diesel::QueryResult<usize>> + Send;

    /// Loads the rows of `query`.
    fn load<T: QueryableByName<Mysql> + Send + 'static>(
        &mut self,
        query: BoxedSqlQuery<'_, Mysql, SqlQuery>,
    ) -> impl Future<Output = diesel::QueryResult<Vec<T>>> + Send;
}

impl Exec for AsyncMysqlConnection {
    async fn execute(
        &mut self,
        query: BoxedSqlQuery<'_, Mysql, SqlQuery>,
    ) -> diesel::QueryResult<usize> {
        RunQueryDsl::execute(query, self).await
    }

    async fn load<T: QueryableByName<Mysql> + Send + 'static>(
        &mut self,
        query: BoxedSqlQuery<'_, Mysql, SqlQuery>,
    ) -> diesel::QueryResult<Vec<T>> {
        RunQueryDsl::load(query, self).await
    }
}

#[cfg(feature = "mysql-sync")]
impl Exec for diesel::MysqlConnection {
    async fn execute(
        &mut self,
        query: BoxedSqlQuery<'_, Mysql, SqlQuery>,
    ) -> diesel::QueryResult<usize> {
        diesel::RunQueryDsl::execute(query, self)
    }

    async fn load<T: QueryableByName<Mysql> + Send + 'static>(
        &mut self,
        query: BoxedSqlQuery<'_, Mysql, SqlQuery>,
    ) -> diesel::QueryResult<Vec<T>> {
        diesel::RunQueryDsl::load(query, self)
    }
}

/// `?, ?, ...` for `n` values, in `(...)` groups of `width`, joined by commas.
fn placeholders(n: usize, width: usize) -> String {
    let group = format!("({})", vec!["?"; width].join(", "));
    groups(n, &group)
}

/// `n` copies of `group`, joined by commas.
fn groups(n: usize, group: &str) -> String {
    vec![group; n].join(", ")
}

/// Takes the dedup keys of `events` and returns the positions of the events not to write
/// (as the PostgreSQL unit of work does; see `outbox::queries::take_dedup_keys`).
///
/// Guarantee: the keys' primary key. An insert of a key another open transaction inserted
/// waits for it (InnoDB locks the duplicate entry); the locking read after it sees the
/// latest committed owner of each key, whatever this transaction's snapshot.
async fn take_dedup_keys<C: Exec>(
    conn: &mut C,
    events: &[NewEvent],
) -> diesel::QueryResult<Vec<usize>> {
    let mut plan = DedupKeys::plan(events);
    let keys: Vec<(&str, String)> = plan
        .keys()
        .into_iter()
        .map(|(key, id)| (key, id.to_string()))
        .collect();
    if keys.is_empty() {
        return Ok(plan.duplicates(events));
    }
    for chunk in keys.chunks(MAX_BOUND_VALUES / 2) {
        let mut insert = diesel::sql_query(format!(
            "INSERT INTO outbox_dedup_keys (dedup_key, event_id) VALUES {} \
             ON DUPLICATE KEY UPDATE dedup_key = dedup_key",
            placeholders(chunk.len(), 2)
        ))
        .into_boxed::<Mysql>();
        for (key, id) in chunk {
            insert = insert.bind::<Text, _>(*key).bind::<Text, _>(id.as_str());
        }
        conn.execute(insert).await?;
        let mut ours = diesel::sql_query(format!(
            "SELECT CAST(dedup_key AS CHAR CHARACTER SET utf8mb4) AS dedup_key \
             FROM outbox_dedup_keys WHERE (dedup_key, event_id) IN ({}) LOCK IN SHARE MODE",
            placeholders(chunk.len(), 2)
        ))
        .into_boxed::<Mysql>();
        for (key, id) in chunk {
            ours = ours.bind::<Text, _>(*key).bind::<Text, _>(id.as_str());
        }
        let taken: Vec<TakenKey> = conn.load(ours).await?;
        plan.taken(&taken);
    }
    Ok(plan.duplicates(events))
}

/// Writes `events`, numbering each aggregate's after its last sequence, in the order given:
/// two statements, a third and fourth only after rows inserted by hand.
///
/// 1. One upsert of `outbox_aggregates` advances each aggregate's counter by its number of
///    events. It takes an exclusive lock on each existing row (InnoDB, "Locks Set by
///    Different SQL Statements"), in sorted order so that two units of work cannot deadlock
///    on them, until COMMIT: a concurrent unit of work on the same aggregate waits, then
///    reads the counter as this one left it and numbers after it. It reads nothing else: a
///    read of `outbox_events` here would take shared gap locks that the next statement's
///    inserts, and those of the units of work waiting here, deadlock on.
/// 2. One insert of the events, each reading its aggregate's new counter (this transaction's
///    own row version, whatever its snapshot) to number itself `counter - count + ordinal`,
///    and its `available_at` (later than now when the relay parked the aggregate behind a
///    rejected row).
///
/// When the insert meets a row with its number (a writer inserted rows by hand above the
/// counter), MySQL undoes that statement alone; the counters are moved past the highest
/// sequence of each aggregate (a locking read, so the latest committed rows) and the insert
/// runs again. A unit of work of more events than one statement binds ([`ROWS_PER_INSERT`]:
/// MySQL takes 65,535 placeholders a statement) is inserted in several statements, after the
/// counters were moved past such rows.
async fn insert_events<C: Exec>(
    conn: &mut C,
    events: &[NewEvent],
    causality: &Causality,
) -> diesel::QueryResult<()> {
    let (ordinals, counts) = numbering(events);
    let mut aggregates: Vec<((&str, &str), i64)> = counts.iter().map(|(k, n)| (*k, *n)).collect();
    aggregates.sort_unstable();

    // In sorted chunks: each locks its rows in order, after the chunks before it.
    for chunk in aggregates.chunks(MAX_BOUND_VALUES / 3) {
        let mut advance = diesel::sql_query(format!(
            "INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq) VALUES {} \
             ON DUPLICATE KEY UPDATE last_seq = last_seq + VALUES(last_seq)",
            placeholders(chunk.len(), 3)
        ))
        .into_boxed::<Mysql>();
        for ((aggregate_type, aggregate_id), n) in chunk {
            advance = advance
                .bind::<Text, _>(*aggregate_type)
                .bind::<Text, _>(*aggregate_id)
                .bind::<BigInt, _>(*n);
        }
        conn.execute(advance).await?;
    }

    // An insert of several statements cannot be run again after one of them met a row
    // inserted by hand (the statements before it stay): it moves the counters past such rows
    // first. One statement is retried instead, which costs nothing when no row was.
    let statements = events.len().div_ceil(ROWS_PER_INSERT);
    if statements > 1 {
        move_past_rows_inserted_by_hand(conn, &aggregates).await?;
        return insert_rows(conn, events, &ordinals, &counts, causality).await;
    }
    match insert_rows(conn, events, &ordinals, &counts, causality).await {
        Err(diesel::result::Error::DatabaseError(
            diesel::result::DatabaseErrorKind::UniqueViolation,
            info,
        )) if info.message().contains("outbox_events_aggregate_seq_key") => {
            move_past_rows_inserted_by_hand(conn, &aggregates).await?;
            insert_rows(conn, events, &ordinals, &counts, causality).await
        }
        other => other,
    }
}

/// The most values one statement binds here: MySQL's limit is 65,535 placeholders a
/// prepared statement (the protocol's 2-byte count; MySQL docs, COM_STMT_PREPARE).
pub(crate) const MAX_BOUND_VALUES: usize = 32_000;

/// The most events one INSERT writes: 16 bound values each, within [`MAX_BOUND_VALUES`].
const ROWS_PER_INSERT: usize = MAX_BOUND_VALUES / 16;

/// Moves each aggregate's counter (already advanced by its `n` events) past the highest
/// sequence of its rows, read with a locking read (the latest committed rows).
async fn move_past_rows_inserted_by_hand<C: Exec>(
    conn: &mut C,
    aggregates: &[((&str, &str), i64)],
) -> diesel::QueryResult<()> {
    for ((aggregate_type, aggregate_id), n) in aggregates {
        let past = diesel::sql_query(
            "UPDATE outbox_aggregates SET last_seq = GREATEST(last_seq, ? + COALESCE(( \
                 SELECT MAX(o.aggregate_seq) FROM outbox_events o \
                 WHERE o.aggregate_type = ? AND o.aggregate_id = ? \
                 FOR UPDATE), 0)) \
             WHERE aggregate_type = ? AND aggregate_id = ?",
        )
        .into_boxed()
        .bind::<BigInt, _>(*n)
        .bind::<Text, _>(*aggregate_type)
        .bind::<Text, _>(*aggregate_id)
        .bind::<Text, _>(*aggregate_type)
        .bind::<Text, _>(*aggregate_id);
        conn.execute(past).await?;
    }
    Ok(())
}

/// The insert of [`insert_events`], numbering after the counters as they stand.
async fn insert_rows<C: Exec>(
    conn: &mut C,
    events: &[NewEvent],
    ordinals: &[i64],
    counts: &HashMap<(&str, &str), i64>,
    causality: &Causality,
) -> diesel::QueryResult<()> {
    let headers = causality.headers_json();
    let ids: Vec<String> = events.iter().map(|e| e.id.to_string()).collect();
    for start in (0..events.len()).step_by(ROWS_PER_INSERT) {
        let end = events.len().min(start + ROWS_PER_INSERT);
        let (events, ordinals, ids) =
            (&events[start..end], &ordinals[start..end], &ids[start..end]);
        let mut insert = diesel::sql_query(format!(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, event_type, \
         event_version, partition_key, subject, payload, available_at, correlation_id, \
         causation_id, headers) VALUES {}",
        groups(
            events.len(),
            "(?, ?, ?, (SELECT a.last_seq FROM outbox_aggregates a \
                 WHERE a.aggregate_type = ? AND a.aggregate_id = ?) - ?, \
              ?, ?, ?, ?, ?, \
              (SELECT GREATEST(UTC_TIMESTAMP(6), COALESCE(a.blocked_until, UTC_TIMESTAMP(6))) \
                 FROM outbox_aggregates a WHERE a.aggregate_type = ? AND a.aggregate_id = ?), \
              ?, ?, ?)"
        )
    ))
    .into_boxed::<Mysql>();
        for ((event, ordinal), id) in events.iter().zip(ordinals).zip(ids) {
            let aggregate = (event.aggregate_type.as_str(), event.aggregate_id.as_str());
            // The event's number is the new counter minus the events after it.
            let after = counts[&aggregate] - *ordinal;
            insert = insert
                .bind::<Text, _>(id.as_str())
                .bind::<Text, _>(aggregate.0)
                .bind::<Text, _>(aggregate.1)
                .bind::<Text, _>(aggregate.0)
                .bind::<Text, _>(aggregate.1)
                .bind::<BigInt, _>(after)
                .bind::<Text, _>(event.event_type)
                .bind::<diesel::sql_types::Integer, _>(event.event_version)
                .bind::<Text, _>(event.partition_key.as_str())
                .bind::<Text, _>(event.subject.as_str())
                .bind::<Text, _>(event.payload.as_str())
                .bind::<Text, _>(aggregate.0)
                .bind::<Text, _>(aggregate.1)
                .bind::<Text, _>(causality.correlation_id.as_str())
                .bind::<Text, _>(causality.causation_id.as_str())
                .bind::<Text, _>(headers.as_str());
        }
        conn.execute(insert).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_older_than_mysql_8_0_16_or_mariadb_10_6_are_told_apart() {
        for (version, older) in [
            ("5.7.44", true),
            ("8.0.15", true),
            ("8.0.16", false),
            ("8.0.28-log", false),
            ("8.0.36-0ubuntu0.22.04.1", false),
            ("8.4.3", false),
            ("9.1.0", false),
            ("10.5.23-MariaDB-0+deb11u1", true),
            ("10.6.0-MariaDB", false),
            ("10.11.6-MariaDB-0+deb12u1", false),
            ("11.4.2-MariaDB-log", false),
            ("8.0.11-TiDB-v7.5.0", false),
            ("not a version", false),
        ] {
            assert_eq!(older_than_supported(version), older, "{version}");
        }
    }

    #[test]
    fn a_url_names_a_database_by_its_path() {
        for url in [
            "mysql://root@127.0.0.1:3306/orders",
            "mysql://app:p%2Fw@db:3306/orders?require_ssl=true",
            "mysql://db/orders#x",
        ] {
            assert!(names_a_database(url), "{url}");
        }
        for url in [
            "mysql://root@127.0.0.1:3306",
            "mysql://root@127.0.0.1:3306/",
            "mysql://root@127.0.0.1:3306?ssl_ca=/etc/ca.pem",
            "mysql://root@127.0.0.1:3306/?ssl_ca=/etc/ca.pem",
        ] {
            assert!(!names_a_database(url), "{url}");
        }
    }

    #[test]
    fn the_mark_is_the_savepoint_each_statement_names() {
        let checked =
            <AsyncMysqlConnection as crate::unit_of_work::sealed::Backend>::CHECKED_COMMIT;
        for statement in [BEGIN, RELEASE, checked.unwrap()] {
            assert!(
                statement.contains(&format!("SAVEPOINT {MARK}")),
                "{statement}"
            );
        }
        let missing = diesel::result::Error::DatabaseError(
            diesel::result::DatabaseErrorKind::Unknown,
            Box::new(format!("SAVEPOINT {MARK} existiert nicht")),
        );
        assert!(matches!(
            mark_error(missing),
            UnitOfWorkError::TransactionEnded
        ));
        let lost = diesel::result::Error::DatabaseError(
            diesel::result::DatabaseErrorKind::Unknown,
            Box::new("Lost connection to server during query".to_owned()),
        );
        assert!(matches!(mark_error(lost), UnitOfWorkError::Database(_)));
    }

    #[test]
    fn outbox_tables_names_each_table_the_migrations_create() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations-mysql");
        let mut created = std::collections::BTreeSet::new();
        for migration in std::fs::read_dir(&dir).unwrap() {
            let up = std::fs::read_to_string(migration.unwrap().path().join("up.sql")).unwrap();
            for statement in up.split("CREATE TABLE ").skip(1) {
                let name = statement.split([' ', '(']).next().unwrap();
                created.insert(name.to_owned());
            }
        }
        let listed: std::collections::BTreeSet<String> = OUTBOX_TABLES
            .split(", ")
            .map(|name| name.trim_matches('\'').to_owned())
            .collect();
        assert_eq!(listed, created);
    }

    #[test]
    fn the_tls_files_are_taken_out_of_the_url_wherever_they_stand() {
        let file = std::env::temp_dir().join(format!("outbox ca {}.pem", uuid::Uuid::new_v4()));
        std::fs::write(&file, "").unwrap();
        let encoded = percent_encoding::utf8_percent_encode(
            &file.display().to_string(),
            percent_encoding::NON_ALPHANUMERIC,
        )
        .to_string();
        let base = "mysql://app:s3cret@db:3306/orders";
        for (query, kept) in [
            (
                format!("ssl_ca={encoded}"),
                format!("{base}?require_ssl=true"),
            ),
            (
                format!("prefer_socket=false&ssl_ca={encoded}&verify_identity=false"),
                format!("{base}?prefer_socket=false&verify_identity=false&require_ssl=true"),
            ),
            (
                format!("require_ssl=false&ssl_ca={encoded}#x"),
                format!("{base}?require_ssl=true#x"),
            ),
        ] {
            let url = format!("{base}?{query}");
            let (url_kept, files) = tls_files(&url).unwrap().unwrap();
            assert_eq!(
                (url_kept, files.authorities, files.identity),
                (kept, Some(file.clone()), None),
                "{url}"
            );
        }
        // mysql_async takes `verify_identity` only with `require_ssl=true`, written for it.
        let (url, _) = tls_files(&format!("{base}?verify_identity=false&ssl_ca={encoded}"))
            .unwrap()
            .unwrap();
        let opts = mysql_async::Opts::from_url(&url).unwrap();
        assert!(opts.ssl_opts().unwrap().skip_domain_validation(), "{url}");
        std::fs::remove_file(&file).unwrap();
        for url in [base.to_owned(), format!("{base}?require_ssl=true")] {
            assert!(tls_files(&url).unwrap().is_none(), "{url}");
        }
        for option in ["ssl_ca", "ssl_cert", "ssl_key"] {
            let error = tls_files(&format!("{base}?{option}={encoded}"))
                .unwrap_err()
                .to_string();
            assert_eq!(error, format!("{option} {}: no such file", file.display()));
        }
    }
}
