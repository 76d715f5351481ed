//! The toolkit's own database connections (the relay's, the inbox's, the migrations'):
//! opened with a connect timeout, bounded by a statement timeout, and named in errors and
//! logs without their password.
//!
//! A server that accepts connections and never answers (a frozen host, a proxy in front of a
//! dead database) would otherwise hang a connect or a query for ever: tokio-postgres sets no
//! timeout of its own. Every connection here is opened within a connect timeout, sets the
//! server-side `statement_timeout` (PostgreSQL docs, section 20.11.1) so that a query stuck
//! on a lock is cancelled by the server, and each query of the relay and the inbox is also
//! bounded on the client side, which is what ends a wait on a server that does not answer
//! at all.
//!
//! [`Pooled`] is a connection of a service's own pool that is closed, not given back to the
//! pool, when it is dropped inside a transaction (a unit of work's future dropped part-way).

use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::time::Duration;

use diesel_async::pooled_connection::PoolableConnection;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use diesel_async::SimpleAsyncConnection;
// PostgreSQL's connections and the parsing of its URLs.
#[cfg(feature = "postgres")]
use {
    diesel_async::AsyncPgConnection, futures::future::BoxFuture, std::str::FromStr, std::sync::Arc,
};

#[cfg(feature = "postgres")]
mod defaults;
#[cfg(feature = "postgres")]
mod password;
#[cfg(feature = "postgres")]
mod service;
#[cfg(feature = "postgres")]
mod tls;

/// A connection the operator's functions run on ([`crate::dead_letter`]'s,
/// [`crate::outbox::purge_published`], [`crate::outbox::purge_dedup_keys`],
/// [`crate::outbox::queued_by_type`], [`crate::outbox::published_last_minute`]): diesel-async's
/// `AsyncPgConnection`; with the feature `mysql`, `AsyncMysqlConnection`; with the feature
/// `sqlite`, `outbox_runtime::sqlite::AsyncSqliteConnection` (wrap a `SqliteConnection` with
/// `AsyncSqliteConnection::new`).
///
/// Sealed: implemented by the toolkit for the databases it has statements for.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[allow(private_bounds)]
pub trait OperatorConnection:
    Send
    + crate::dead_letter::sealed::DeadLetters
    + crate::outbox::purge::sealed::Purges
    + crate::outbox::report::sealed::Reports
{
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl<C> OperatorConnection for C where
    C: Send
        + crate::dead_letter::sealed::DeadLetters
        + crate::outbox::purge::sealed::Purges
        + crate::outbox::report::sealed::Reports
{
}

/// The default connect timeout of the relay, the inbox and [`crate::run_migrations`]: 10 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The default statement timeout of the relay's and the inbox's queries: 30 s.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection to the database could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot connect to the database at {target}: {reason}")]
pub struct ConnectError {
    /// Where: the URL without its password (see [`redacted`]).
    pub target: String,
    /// What went wrong: the server's or the driver's message, or the timeout.
    pub reason: String,
}

/// A query of the toolkit's own did not finish in time; its connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the database at {target} did not answer {operation} within {after:?}")]
pub struct TimedOut {
    /// Where: the URL without its password.
    pub target: String,
    /// The query that did not finish, in words ("the relay's claim").
    pub operation: &'static str,
    /// The statement timeout that ran out.
    pub after: Duration,
}

/// `database_url` as it may be shown: the user, hosts, ports and database of a
/// `postgres://` URL or of a `key=value` connection string, never the password; the user,
/// host, port and database of a `mysql://` URL (without its password and parameters); a
/// SQLite database's path as it is (`sqlite://` URL, `file:` URI without its parameters, or a
/// plain path). A string that does not parse is not shown at all; an empty one is shown as
/// `<an empty database URL>`.
///
/// ```
/// use outbox_runtime::database::redacted;
/// assert_eq!(
///     redacted("postgres://app:s3cret@db.internal:5433/orders"),
///     "postgres://app@db.internal:5433/orders"
/// );
/// assert_eq!(redacted("host=db password=s3cret dbname=orders"), "postgres://db/orders");
/// assert_eq!(
///     redacted("host=/run/postgresql dbname=orders"),
///     "postgres://%2Frun%2Fpostgresql/orders"
/// );
/// assert_eq!(
///     redacted("mysql://app:s3cret@db.internal:3306/orders?ssl-mode=required"),
///     "mysql://app@db.internal:3306/orders"
/// );
/// assert_eq!(redacted("/var/lib/orders/outbox.db"), "/var/lib/orders/outbox.db");
/// assert_eq!(redacted(""), "<an empty database URL>");
/// ```
pub fn redacted(database_url: &str) -> String {
    // tokio-postgres parses the empty string, as a URL of nothing ("postgres://").
    if database_url.trim().is_empty() {
        return "<an empty database URL>".to_owned();
    }
    #[cfg(feature = "postgres")]
    if let Some(text) = redacted_postgres(database_url) {
        return text;
    }
    redacted_other(database_url)
}

/// What [`redacted`] percent-encodes in a Unix socket's directory: `/`, `%`, `:`, `@`, `,`
/// and what a URL never holds as it is.
#[cfg(all(feature = "postgres", unix))]
const SOCKET_PATH: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS
    .add(b' ')
    .add(b'/')
    .add(b'%')
    .add(b':')
    .add(b'@')
    .add(b',')
    .add(b'?')
    .add(b'#');

/// [`redacted`] for what tokio-postgres parses: a `postgres://` URL or a `key=value`
/// connection string.
#[cfg(feature = "postgres")]
fn redacted_postgres(database_url: &str) -> Option<String> {
    // Without the TLS options tokio-postgres does not know (`sslmode=verify-full`,
    // `sslrootcert`) and the service file's `service`, which would make it refuse the whole
    // string; the service is shown after the rest.
    let written = service::Written::of(database_url);
    let without_service = written.without_service(database_url);
    let config = tokio_postgres::Config::from_str(&tls::parsable(&without_service)).ok()?;
    let mut text = String::from("postgres://");
    if let Some(user) = config.get_user() {
        text.push_str(user);
        text.push('@');
    }
    let ports = config.get_ports();
    for (index, host) in config.get_hosts().iter().enumerate() {
        if index > 0 {
            text.push(',');
        }
        match host {
            tokio_postgres::config::Host::Tcp(name) => text.push_str(name),
            #[cfg(unix)]
            // Percent-encoded, as libpq's URLs write a socket's directory: shown as a path,
            // `postgres:///run/postgresql/orders` read as the database `run/postgresql/orders`.
            tokio_postgres::config::Host::Unix(path) => text.extend(
                percent_encoding::utf8_percent_encode(&path.to_string_lossy(), SOCKET_PATH),
            ),
        }
        let port = ports.get(index).or(ports.first());
        if let Some(port) = port.filter(|port| **port != 5432) {
            text.push(':');
            text.push_str(&port.to_string());
        }
    }
    if let Some(dbname) = config.get_dbname() {
        text.push('/');
        text.push_str(dbname);
    }
    if let Some(name) = written.service {
        text.push_str("?service=");
        text.extend(percent_encoding::utf8_percent_encode(
            &name,
            percent_encoding::NON_ALPHANUMERIC,
        ));
    }
    Some(text)
}

/// The database a URL names, by its form: `postgres://` or `postgresql://` (or a PostgreSQL
/// `key=value` connection string), `mysql://`, or else a SQLite file (a path, `sqlite://` or
/// a `file:` URI). A service that takes its database from configuration picks its
/// connection and its relay by it (the quickstart does), parsing it (`url.parse::<Kind>()`),
/// which refuses an empty URL and one of another scheme ([`ParseKindError`]: a typo such as
/// `postgress://`) where [`Kind::of`] takes them for a SQLite file's path.
///
/// ```
/// use outbox_runtime::database::Kind;
/// assert_eq!(Kind::of("postgres://app@db/orders"), Kind::Postgres);
/// assert_eq!(Kind::of("mysql://app@db/orders"), Kind::Mysql);
/// assert_eq!(Kind::of("/var/lib/orders.db"), Kind::Sqlite);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// PostgreSQL: `outbox_runtime::Relay` (feature `postgres`, on by default).
    Postgres,
    /// MySQL or MariaDB: `outbox_runtime::mysql` (feature `mysql`).
    Mysql,
    /// A SQLite file: `outbox_runtime::sqlite` (feature `sqlite`).
    Sqlite,
}

impl Kind {
    /// The database `database_url` names, by its form (nothing is opened).
    pub fn of(database_url: &str) -> Self {
        let url = database_url.trim_start();
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Self::Postgres
        } else if url.starts_with("mysql://") {
            Self::Mysql
        } else if url.starts_with("sqlite://") || url.starts_with("file:") {
            Self::Sqlite
        } else if url.contains('=') {
            // A `key=value` connection string.
            Self::Postgres
        } else {
            Self::Sqlite
        }
    }

    /// The scheme of `database_url` when it is a URL (`scheme://`, RFC 3986's scheme syntax)
    /// of no database the outbox runs on, such as a typo (`postgress://`) or another
    /// program's (`redis://`): [`Kind::of`] would take it for a SQLite file's path.
    fn unknown_scheme(database_url: &str) -> Option<&str> {
        let (scheme, _) = database_url.trim_start().split_once("://")?;
        let mut chars = scheme.chars();
        let is_scheme = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
            && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        let known = ["postgres", "postgresql", "mysql", "sqlite", "file"];
        // Compared as written: tokio-postgres and diesel take the lower-case schemes only.
        (is_scheme && !known.contains(&scheme)).then_some(scheme)
    }

    /// Refuses a URL of another database than `self`, for `user` (a relay, a command), naming
    /// the relay to use.
    ///
    /// # Errors
    /// The message to show, naming the URL without its password: an empty URL, or another
    /// database's.
    pub fn check(self, database_url: &str, user: &str) -> Result<(), String> {
        if database_url.trim().is_empty() {
            return Err(format!(
                "database_url is empty: {user} needs its database's URL"
            ));
        }
        let kind = database_url
            .parse::<Self>()
            .map_err(|error| format!("database_url: {error}"))?;
        let url = redacted(database_url);
        if kind == self {
            return Ok(());
        }
        let right = match kind {
            Self::Postgres => "outbox_runtime::Relay (feature `postgres`)",
            Self::Mysql => "outbox_runtime::mysql::MysqlRelay (feature `mysql`)",
            Self::Sqlite => "outbox_runtime::sqlite::SqliteRelay (feature `sqlite`)",
        };
        let what = match kind {
            Self::Postgres => "a PostgreSQL URL",
            Self::Mysql => "a MySQL URL",
            Self::Sqlite => "a SQLite file",
        };
        Err(format!(
            "database_url {url} is {what}, which {user} does not work on: use {right}"
        ))
    }
}

/// [`Kind::of`], but a URL of a scheme no database of the outbox has (`postgress://`,
/// `redis://`) is an error rather than a SQLite file's path.
///
/// ```
/// use outbox_runtime::database::{Kind, ParseKindError};
/// assert_eq!("postgres://app@db/orders".parse::<Kind>().unwrap(), Kind::Postgres);
/// assert_eq!("orders.db".parse::<Kind>().unwrap(), Kind::Sqlite);
/// let error = "postgress://app:s3cret@db/orders".parse::<Kind>().unwrap_err();
/// assert!(error.to_string().starts_with("a postgress:// URL names no database"));
/// assert_eq!("".parse::<Kind>(), Err(ParseKindError::Empty));
/// ```
impl std::str::FromStr for Kind {
    type Err = ParseKindError;

    fn from_str(database_url: &str) -> Result<Self, ParseKindError> {
        if let Some(error) = names_no_file(database_url) {
            return Err(error);
        }
        match Self::unknown_scheme(database_url) {
            Some(scheme) => Err(ParseKindError::UnknownScheme {
                scheme: scheme.to_owned(),
            }),
            None => Ok(Self::of(database_url)),
        }
    }
}

/// The file a SQLite database URL names: a plain path as it is, a `sqlite://` URL's path, or
/// a `file:` URI's path (after an empty or `localhost` authority, without its parameters,
/// percent-decoded: SQLite docs, "Uniform Resource Identifiers", section 3). `None` for an
/// in-memory database (`:memory:`, or a `file:` URI whose path is that or whose `mode` is
/// `memory`) and a URL that names no path.
///
/// ```
/// use std::path::PathBuf;
/// use outbox_runtime::database::sqlite_file;
/// assert_eq!(sqlite_file("/var/lib/orders.db"), Some(PathBuf::from("/var/lib/orders.db")));
/// assert_eq!(sqlite_file("sqlite://orders.db"), Some(PathBuf::from("orders.db")));
/// assert_eq!(
///     sqlite_file("file://localhost/var/lib/my%20orders.db?mode=ro"),
///     Some(PathBuf::from("/var/lib/my orders.db"))
/// );
/// assert_eq!(sqlite_file("file::memory:?cache=shared"), None);
/// ```
pub fn sqlite_file(database_url: &str) -> Option<std::path::PathBuf> {
    let url = database_url.trim();
    let path = if let Some(path) = url.strip_prefix("sqlite://") {
        path.to_owned()
    } else if let Some(uri) = url.strip_prefix("file:") {
        let (path, parameters) = uri.split_once('?').unwrap_or((uri, ""));
        let path = path.split('#').next().unwrap_or_default();
        let path = match path.strip_prefix("//") {
            Some(authority_and_path) => {
                let at = authority_and_path.find('/')?;
                match &authority_and_path[..at] {
                    "" | "localhost" => &authority_and_path[at..],
                    // SQLite refuses any other authority.
                    _ => return None,
                }
            }
            None => path,
        };
        let in_memory = parameters
            .split(['&', '#'])
            .any(|parameter| parameter == "mode=memory");
        if in_memory {
            return None;
        }
        percent_encoding::percent_decode_str(path)
            .decode_utf8_lossy()
            .into_owned()
    } else {
        url.to_owned()
    };
    (!path.trim().is_empty() && path != ":memory:").then(|| std::path::PathBuf::from(path))
}

/// Fails, naming the path, where the SQLite database `database_url` names is a file that does
/// not exist: the relay and the inbox open the database the service's migrations made, and
/// must not make an empty one at a mistyped path (SQLite creates the file it is asked to
/// open), which the migrations would then make a second outbox of.
#[cfg(feature = "sqlite")]
pub(crate) fn sqlite_file_exists(database_url: &str) -> Result<(), String> {
    match sqlite_file(database_url) {
        Some(path) if !path.exists() => Err(format!(
            "no SQLite database at {}: the relay and the inbox open the database that the \
             service's migrations made, and make none; check the path",
            path.display()
        )),
        _ => Ok(()),
    }
}

/// Why `database_url` names no database at all: it is empty or blank
/// ([`ParseKindError::Empty`]), or a `sqlite://` URL or `file:` URI whose path (without the
/// URI's parameters) is ([`ParseKindError::NoSqlitePath`]). SQLite opens a temporary database
/// of its own for an empty path, deleted when the connection closes (SQLite docs, "In-Memory
/// Databases", section "Temporary Databases").
pub(crate) fn names_no_file(database_url: &str) -> Option<ParseKindError> {
    let url = database_url.trim();
    if url.is_empty() {
        return Some(ParseKindError::Empty);
    }
    let path = match url.strip_prefix("sqlite://") {
        Some(path) => path,
        None => url.strip_prefix("file:")?.split(['?', '#']).next()?,
    };
    path.trim()
        .is_empty()
        .then(|| ParseKindError::NoSqlitePath {
            url: url.to_owned(),
        })
}

/// A database URL that names no database the outbox runs on ([`Kind`]'s `FromStr`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseKindError {
    /// The URL is empty or blank ([`Kind::of`] would take it for a SQLite file's path): an
    /// environment variable set to nothing, say.
    #[error(
        "the database URL is empty: give postgres://... (PostgreSQL), mysql://... (MySQL, \
         MariaDB) or a SQLite file's path"
    )]
    Empty,
    /// The URL's scheme is none of the outbox's databases: a typo such as `postgress://`, or
    /// another program's (`redis://`).
    #[error(
        "a {scheme}:// URL names no database the outbox runs on: postgres:// or postgresql:// \
         (PostgreSQL, or a key=value connection string), mysql:// (MySQL, MariaDB), or a SQLite \
         file (its path, sqlite:// or file:)"
    )]
    UnknownScheme {
        /// The URL's scheme, as written (without `://`).
        scheme: String,
    },
    /// A `sqlite://` URL or `file:` URI with no path (`sqlite://`, a variable that held the
    /// path set to nothing): SQLite would open a temporary database of its own, which no
    /// other connection sees and which is gone when the connection closes, so migrations
    /// would be applied to nothing and events written there lost.
    #[error(
        "the SQLite URL {url:?} names no file: SQLite would open a temporary database that \
         vanishes with its connection; give sqlite://path/to/outbox.db, a file: URI with a \
         path, or the file's path"
    )]
    NoSqlitePath {
        /// The URL, as written (it holds no secret: a SQLite URL has no password).
        url: String,
    },
}

/// [`redacted`] for what is not PostgreSQL's (or, in a build without the `postgres`
/// feature, for everything: a `postgres://` URL is then shown as a `mysql://` one is).
fn redacted_other(database_url: &str) -> String {
    let without_parameters = |text: &str| text.split(['?', '#']).next().unwrap_or("").to_owned();
    // With the `postgres` feature, tokio-postgres parses PostgreSQL's URLs first, and one it
    // cannot parse is not shown.
    #[cfg(feature = "postgres")]
    let url_schemes = ["mysql://"];
    #[cfg(not(feature = "postgres"))]
    let url_schemes = ["mysql://", "postgres://", "postgresql://"];
    if let Some((scheme, rest)) = url_schemes
        .iter()
        .find_map(|scheme| Some((*scheme, database_url.strip_prefix(scheme)?)))
    {
        // The user information ends at the last `@`, wherever a password written raw puts a
        // `/`, `?` or `#`; only the user name before its `:` is shown.
        let (user, rest) = match rest.rsplit_once('@') {
            Some((userinfo, rest)) => (userinfo.split(':').next().unwrap_or(""), rest),
            None => ("", rest),
        };
        let rest = without_parameters(rest);
        let (host, path) = rest.split_once('/').unwrap_or((rest.as_str(), ""));
        let at = if user.is_empty() { "" } else { "@" };
        return format!("{scheme}{user}{at}{host}/{path}");
    }
    if database_url.starts_with("sqlite://") || database_url.starts_with("file:") {
        return without_parameters(database_url);
    }
    if !database_url.contains("://") && !database_url.contains(['=', '@']) {
        return database_url.to_owned();
    }
    "<a database URL that does not parse>".to_owned()
}

/// A database URL that shows itself redacted in `Debug` and `Display`.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Redacted<'a>(pub &'a str);

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&redacted(self.0), f)
    }
}

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redacted(self.0))
    }
}

/// Opens the connections of a relay or an inbox the service's own way: with the TLS, the
/// credentials and the setup its pool already has. Set it as
/// [`RelayConfig::connector`](crate::RelayConfig::connector) or
/// [`InboxConfig::connector`](crate::InboxConfig::connector); `database_url` then only names
/// the database in logs and errors (without its password).
///
/// The toolkit owns each connection it opens this way for as long as it needs it (a relay
/// worker's for the relay's life), and sets its `application_name`, `statement_timeout` and
/// server-side TCP keepalives (a session whose client vanished is closed within about 25 s,
/// its locks released) as it does on its own. Each is opened within the configured
/// `connect_timeout`.
///
/// ```no_run
/// use outbox_runtime::database::Connector;
/// use outbox_runtime::diesel_async::pooled_connection::deadpool::Pool;
/// use outbox_runtime::diesel_async::pooled_connection::AsyncDieselConnectionManager;
/// use outbox_runtime::diesel_async::{AsyncConnection, AsyncPgConnection};
///
/// // From a closure: any way of opening a connection.
/// let url = std::env::var("DATABASE_URL").unwrap();
/// let connector = Connector::new(move || {
///     let url = url.clone();
///     async move { AsyncPgConnection::establish(&url).await }
/// });
///
/// // From the service's deadpool pool (see `from_pool`). With bb8, call the pool's manager
/// // in a closure: `AsyncDieselConnectionManager` opens connections through bb8's
/// // `ManageConnection::connect`, with the pool's own setup.
/// let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new("postgres://app@db/shop");
/// let pool = Pool::builder(manager).max_size(8).build().unwrap();
/// let connector = Connector::from_pool(pool);
/// ```
#[cfg(feature = "postgres")]
#[derive(Clone)]
pub struct Connector(Arc<ConnectFn>);

#[cfg(feature = "postgres")]
type ConnectFn = dyn Fn() -> BoxFuture<'static, Result<AsyncPgConnection, String>> + Send + Sync;

#[cfg(feature = "postgres")]
impl Connector {
    /// A connector that calls `connect` for each connection. Its error's `Display` text
    /// becomes the [`ConnectError`]'s reason.
    pub fn new<F, Fut, E>(connect: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<AsyncPgConnection, E>> + Send + 'static,
        E: fmt::Display,
    {
        Self(Arc::new(move || {
            let opening = connect();
            Box::pin(async move { opening.await.map_err(|e| e.to_string()) })
        }))
    }

    /// A connector that opens connections through the service's deadpool `pool` (its
    /// manager's URL and `custom_setup`: TLS, credentials) and takes each out of the pool
    /// (deadpool's `Object::take`): the toolkit's long-lived connections never hold the
    /// pool's slots, and the pool opens new ones in their place. How many each holds:
    /// [`RelayConfig::connector`](crate::RelayConfig::connector),
    /// [`InboxConfig::connector`](crate::InboxConfig::connector).
    pub fn from_pool(
        pool: diesel_async::pooled_connection::deadpool::Pool<AsyncPgConnection>,
    ) -> Self {
        Self::new(move || {
            let pool = pool.clone();
            async move {
                pool.get()
                    .await
                    .map(diesel_async::pooled_connection::deadpool::Object::take)
            }
        })
    }

    async fn open(&self) -> Result<AsyncPgConnection, String> {
        (self.0)().await
    }
}

#[cfg(feature = "postgres")]
impl fmt::Debug for Connector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Connector(..)")
    }
}

/// The server-side TCP keepalives of the toolkit's PostgreSQL sessions (PostgreSQL docs,
/// section 20.3.1, `tcp_keepalives_idle`, `tcp_keepalives_interval`, `tcp_keepalives_count`):
/// after 10 s without traffic the server probes the client every 5 s, and closes the session
/// after 3 unanswered probes. A relay whose host vanished (a node lost, a network cut: no
/// FIN, no RST) holds its claimed heads locked in an open transaction until the server
/// notices; with the operating system's defaults (Linux: 7,200 s, then 9 probes 75 s apart)
/// that is over two hours, during which no other relay publishes those aggregates, and the
/// rows published again after it fall outside the stream's duplicate window. With these it
/// is about 25 s. A live client's kernel answers the probes however busy the process is,
/// so a slow relay is never cut. Ignored on a Unix-domain socket.
#[cfg(feature = "postgres")]
const DEAD_PEER_KEEPALIVES: (Duration, Duration, u32) =
    (Duration::from_secs(10), Duration::from_secs(5), 3);

/// The server-side `tcp_user_timeout` of the toolkit's PostgreSQL sessions (PostgreSQL 12+,
/// docs section 20.3.1): how long data the server sent may stay unacknowledged before it
/// closes the session. Keepalives only probe a connection with nothing unacknowledged: a
/// client that vanished just as the server answered it (a claim's rows sent, not yet
/// acknowledged) would otherwise hold its locks through TCP's retransmissions, some 15
/// minutes (Linux's `tcp_retries2`).
#[cfg(feature = "postgres")]
const DEAD_PEER_USER_TIMEOUT: Duration = Duration::from_secs(25);

/// Takes a session out of the server's `idle_session_timeout` (PostgreSQL 14+, docs section
/// 20.11.1, "Statement Behavior": the server ends a session idle outside a transaction for
/// longer), which an operator may set on the database or role to end the sessions an
/// application forgot. The toolkit's sessions are idle by design: a relay's `LISTEN`
/// connection waits for notifications, its workers for their poll, an inbox's pooled sessions
/// for messages; ended, the relay lost its doorbell and logged a warning at every timeout, and
/// each session was opened again. Dead peers are found by [`DEAD_PEER_KEEPALIVES`] instead.
/// Through `pg_settings`, so that before 14, without the setting, it changes nothing.
#[cfg(feature = "postgres")]
const NO_IDLE_SESSION_TIMEOUT: &str =
    "SELECT set_config(name, '0', false) FROM pg_settings WHERE name = 'idle_session_timeout'";

/// How the toolkit opens and bounds a connection.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub connect_timeout: Duration,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub statement_timeout: Duration,
}

/// Opens a connection to the PostgreSQL database `database_url` names (a URL or a
/// `key=value` string) within `connect_timeout`, as diesel-async's
/// `AsyncPgConnection::establish` does, with no session settings of the toolkit's: for an
/// operator's or a tool's connection. As libpq, it takes what the string leaves out from the
/// connection service file's section that its `service` or `PGSERVICE` names, then from
/// `PGHOST`, `PGHOSTADDR`, `PGPORT`, `PGUSER`, `PGDATABASE`, `PGOPTIONS`, `PGPASSWORD`, the
/// password file and the `PGSSL...` variables (a string without a host: a Unix socket of
/// `/var/run/postgresql` or `/tmp`, else `localhost`), and negotiates no TLS over a Unix
/// socket (PostgreSQL docs, "libpq: The Connection Service File", "libpq: Environment
/// Variables", "libpq: Parameter Key Words").
///
/// # Errors
/// [`ConnectError`]: the database without its password ([`redacted`]) and why, with
/// tokio-postgres's cause, which its own message leaves out ("error connecting to server:
/// Connection refused (os error 111)", "invalid connection string: invalid value for option
/// `sslmode`", the server's message), and the variables the connection took from the
/// environment, with their values ("from the environment: PGHOST=db.internal"), and the
/// service that gave settings ("service orders of /home/app/.pg_service.conf: host=db,
/// password"); a variable whose value is not one (`PGPORT=abc`); a service found in no file
/// (`definition of service "orders" not found`) or a line of its file that is not `key=value`; a connection string that does not parse is shown
/// without the parser's words when they quote it (they could quote a password); or "no
/// answer within" `connect_timeout`.
#[cfg(feature = "postgres")]
pub async fn establish_postgres(
    database_url: &str,
    connect_timeout: Duration,
) -> Result<AsyncPgConnection, ConnectError> {
    within_connect_timeout(database_url, connect_timeout, establish(database_url)).await
}

/// Connects to `database_url` as diesel-async's `establish` does, keeping in the error what
/// tokio-postgres puts in its cause: its own message says only "error connecting to server"
/// or "invalid connection string", and the cause names what is wrong ("Connection refused",
/// "invalid value for option `sslmode`").
///
/// With `sslmode=require`, `verify-ca` or `verify-full` in `database_url` the connection is
/// TLS, its server's certificate verified as the mode and `sslrootcert` ask, and the client
/// certificate of `sslcert` and `sslkey` shown to a server that asks for one ([`tls`]);
/// with `prefer` or no `sslmode`, TLS only where the server refuses a session without it;
/// over Unix sockets only, without TLS whatever the mode, as libpq. What the string leaves
/// out comes from the connection service file's section it or `PGSERVICE` names
/// ([`service`]), then libpq's environment and defaults ([`defaults`], [`password`]), and the
/// error of a connection that fails names what was taken so.
#[cfg(feature = "postgres")]
async fn establish(database_url: &str) -> Result<AsyncPgConnection, String> {
    // The settings of a service file's section, written in where the string gives none.
    let (database_url, service) = service::expand(database_url)?;
    let database_url = database_url.as_ref();
    let parsed = |text: &str| -> Result<_, String> {
        let mut config: tokio_postgres::Config = text.parse().map_err(|error| explained(&error))?;
        let taken = defaults::fill(&mut config, text)?;
        Ok((config, taken))
    };
    // Where the hosts are known (the string's, the environment's, libpq's default), the TLS
    // the string's options ask for.
    let (mut config, taken) = parsed(&tls::parsable(database_url))?;
    let (tls, identity) = if over_unix_sockets(&config) {
        // "sslmode is ignored for Unix domain socket communication" (PostgreSQL docs, "libpq:
        // Parameter Key Words"): libpq negotiates no TLS over a socket, whatever the mode,
        // nor looks for certificates, and a server takes none there. rustls, asked, would
        // fail for want of a host name.
        config.ssl_mode(tokio_postgres::config::SslMode::Disable);
        (tls::Tls::Off, None)
    } else {
        let (text, tls, identity) = tls::split(database_url)?;
        (config, _) = parsed(&text)?;
        (tls, identity)
    };
    let ignored = password::fill(&mut config, tls::passfile(database_url).as_deref());
    let opened = match tls.connector(identity.as_ref())? {
        None => open(&config, tokio_postgres::NoTls).await,
        Some(connector) => open(&config, connector).await,
    };
    let opened = match opened {
        // `prefer` (or no sslmode), and a server that takes TLS sessions only (its pg_hba.conf
        // has a `hostssl` line for the session and no `host` one: its words since 12): TLS
        // without verifying the certificate, as libpq's `prefer` gives it.
        Err(error) if tls == tls::Tls::Prefer && error.contains(", no encryption") => {
            config.ssl_mode(tokio_postgres::config::SslMode::Require);
            let connector = tls::Tls::Unverified
                .connector(None)?
                .ok_or("TLS: no connector for an unverified session")?;
            open(&config, connector).await.map_err(|retried| {
                format!("{retried} (with TLS, after the server refused a session without: {error})")
            })
        }
        opened => opened,
    };
    opened.map_err(|error| {
        let error = match (&ignored, &identity) {
            // Why there was no password, where the want of one failed the connection.
            (Some(ignored), _) if error.ends_with("password missing") => {
                format!("{error} ({ignored})")
            }
            // A fatal alert is the server's word on the handshake: with a client certificate
            // sent, most often that it does not take it (an authority it does not trust:
            // UnknownCA; expired: CertificateExpired; not for clients: UnsupportedCertificate).
            (_, Some(identity)) if error.contains("received fatal alert: ") => format!(
                "{error} (the server refused the TLS handshake, where the client certificate \
                 sslcert {} was sent: is it signed by an authority of the server's \
                 ssl_ca_file, and current?)",
                identity.certificate.display()
            ),
            // The server's pg_hba.conf has a `hostssl` line for this session and no `host` or
            // `hostnossl` one (PostgreSQL docs, "The pg_hba.conf File"): its words since 12.
            _ if tls == tls::Tls::Off && error.contains(", no encryption") => format!(
                "{error} (the server takes this session only over TLS, and sslmode=disable \
                 asks for none: sslmode=require, or verify-full with sslrootcert, asks for it)"
            ),
            _ => error,
        };
        // What the connection took that the string, shown with the error, does not say.
        let taken: Vec<&str> = [service.as_deref(), taken.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        if taken.is_empty() {
            error
        } else {
            format!("{error} ({})", taken.join("; "))
        }
    })
}

/// Whether `config` connects over Unix sockets only: every host a socket's directory, and no
/// `hostaddr`.
#[cfg(feature = "postgres")]
fn over_unix_sockets(config: &tokio_postgres::Config) -> bool {
    #[cfg(unix)]
    {
        let hosts = config.get_hosts();
        config.get_hostaddrs().is_empty()
            && !hosts.is_empty()
            && hosts
                .iter()
                .all(|host| matches!(host, tokio_postgres::config::Host::Unix(_)))
    }
    #[cfg(not(unix))]
    {
        let _ = config;
        false
    }
}

/// Connects with `config` through `tls` (tokio-postgres's connector: none, or rustls), the
/// error tokio-postgres's with its cause ([`explained`]).
#[cfg(feature = "postgres")]
async fn open<T>(config: &tokio_postgres::Config, tls: T) -> Result<AsyncPgConnection, String>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>,
    T::Stream: Send + 'static,
{
    let (client, connection) = config
        .connect(tls)
        .await
        .map_err(|error| explained(&error))?;
    AsyncPgConnection::try_from_client_and_connection(client, connection)
        .await
        .map_err(|error| error.to_string())
}

/// tokio-postgres's `error` with its cause: the server's message for a server's error; for a
/// connection string that does not parse, only a cause that names an option (its other
/// causes quote the string, which may hold a password).
#[cfg(feature = "postgres")]
fn explained(error: &tokio_postgres::Error) -> String {
    if let Some(server) = error.as_db_error() {
        return server.message().to_owned();
    }
    let Some(cause) = std::error::Error::source(error).map(ToString::to_string) else {
        return error.to_string();
    };
    let parse = error.to_string() == "invalid connection string";
    let names_an_option =
        cause.starts_with("unknown option `") || cause.starts_with("invalid value for option `");
    if parse && !names_an_option {
        error.to_string()
    } else {
        format!("{error}: {cause}")
    }
}

/// The isolation level of a connection's transactions.
#[cfg(feature = "postgres")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// What the database, the role or the server sets (`default_transaction_isolation`):
    /// for a connection whose transactions are the user's (an inbox handler's).
    Default,
    /// READ COMMITTED whatever the database's default: for the migrations, and the relay,
    /// whose claims are written for it (`FOR UPDATE SKIP LOCKED` takes the heads committed
    /// by the time each statement starts). Under REPEATABLE READ a claim of a row another
    /// relay just released fails with "could not serialize access due to concurrent
    /// update"; under SERIALIZABLE the relay's reads of `outbox_events` join the writers'
    /// predicate locks and abort units of work with "read/write dependencies among
    /// transactions" (PostgreSQL docs, "Transaction Isolation"; a READ COMMITTED
    /// transaction takes no SIRead locks).
    ReadCommitted,
}

/// Opens a connection (with `connector`, or to `database_url`) within
/// `limits.connect_timeout`, names it `application_name` in `pg_stat_activity` where the
/// string (its `application_name`), `PGAPPNAME` and the role's settings name it nothing (as
/// libpq's `fallback_application_name`: an operator's name for the service's sessions
/// stays), and sets its
/// server-side `statement_timeout` (none when zero), [`DEAD_PEER_KEEPALIVES`],
/// [`DEAD_PEER_USER_TIMEOUT`], [`NO_IDLE_SESSION_TIMEOUT`], when `isolation` says so its
/// transactions' isolation, and with `idle_in_transaction` its
/// `idle_in_transaction_session_timeout` (the longest a transaction may wait for its client;
/// none past `i32::MAX` milliseconds, PostgreSQL's most), where `None` keeps the database's.
#[cfg(feature = "postgres")]
pub(crate) async fn connect(
    database_url: &str,
    connector: Option<&Connector>,
    application_name: &str,
    limits: Limits,
    isolation: Isolation,
    idle_in_transaction: Option<Duration>,
) -> Result<AsyncPgConnection, ConnectError> {
    if connector.is_none() {
        // The PostgreSQL driver would say only that the string does not parse.
        let kind = database_url.parse::<Kind>().map_err(|error| ConnectError {
            target: redacted(database_url),
            reason: error.to_string(),
        })?;
        let other = match kind {
            Kind::Postgres => None,
            Kind::Mysql => Some(("a MySQL URL", "outbox_runtime::mysql (feature `mysql`)")),
            Kind::Sqlite => Some(("a SQLite file", "outbox_runtime::sqlite (feature `sqlite`)")),
        };
        if let Some((kind, other)) = other {
            return Err(ConnectError {
                target: redacted(database_url),
                reason: format!(
                    "{application_name} connects to PostgreSQL, and this is {kind}: its outbox \
                     is {other}"
                ),
            });
        }
    }
    let setup = async {
        let mut conn = match connector {
            Some(connector) => connector.open().await?,
            None => establish(database_url).await?,
        };
        // 0 switches the server-side timeout off (the migrations' connection).
        let statement_ms = limits.statement_timeout.as_millis();
        let (idle, interval, count) = DEAD_PEER_KEEPALIVES;
        // The component's name where the string, PGAPPNAME and the role's settings give none:
        // libpq's fallback_application_name (PostgreSQL docs, "libpq: Parameter Key Words").
        let mut settings = format!(
            "SELECT set_config('application_name', '{application_name}', false) \
             WHERE current_setting('application_name') = ''; \
             SET statement_timeout TO {statement_ms}; \
             SET tcp_keepalives_idle TO {}; SET tcp_keepalives_interval TO {}; \
             SET tcp_keepalives_count TO {count}; SET tcp_user_timeout TO {}; \
             {NO_IDLE_SESSION_TIMEOUT}",
            idle.as_secs(),
            interval.as_secs(),
            DEAD_PEER_USER_TIMEOUT.as_millis()
        );
        if isolation == Isolation::ReadCommitted {
            settings.push_str("; SET default_transaction_isolation TO 'read committed'");
        }
        if let Some(limit) = idle_in_transaction {
            // 0 is no limit, as is anything PostgreSQL's int of milliseconds cannot hold.
            let ms = i32::try_from(limit.as_millis()).unwrap_or(0);
            settings.push_str(&format!(
                "; SET idle_in_transaction_session_timeout TO {ms}"
            ));
        }
        conn.batch_execute(&settings)
            .await
            .map_err(|e| e.to_string())?;
        Ok(conn)
    };
    within_connect_timeout(database_url, limits.connect_timeout, setup).await
}

/// Runs `setup` (a connection and its session settings) within `limit`; its error, or the
/// timeout, is a [`ConnectError`] naming the database without its password.
pub(crate) async fn within_connect_timeout<C>(
    database_url: &str,
    limit: Duration,
    setup: impl Future<Output = Result<C, String>>,
) -> Result<C, ConnectError> {
    let error = |reason: String| ConnectError {
        target: redacted(database_url),
        reason,
    };
    tokio::time::timeout(limit, setup)
        .await
        .map_err(|_| error(format!("no answer within the connect timeout of {limit:?}")))?
        .map_err(error)
}

/// Opens a MySQL / MariaDB connection within the connect timeout, in READ COMMITTED (each
/// statement of the relay sees the latest committed rows, as on PostgreSQL), whose server
/// closes it after `wait_timeout` (whole seconds) without a statement.
#[cfg(feature = "mysql")]
pub(crate) async fn connect_mysql(
    database_url: &str,
    limits: Limits,
    wait_timeout: Duration,
) -> Result<diesel_async::AsyncMysqlConnection, ConnectError> {
    let setup = async {
        let mut conn = crate::mysql::establish(database_url)
            .await
            .map_err(|e| e.to_string())?;
        conn.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .await
            .map_err(|e| e.to_string())?;
        conn.batch_execute(&format!(
            "SET SESSION wait_timeout = {}",
            wait_timeout.as_secs().max(1)
        ))
        .await
        .map_err(|e| e.to_string())?;
        Ok(conn)
    };
    within_connect_timeout(database_url, limits.connect_timeout, setup).await
}

/// Opens a SQLite database file for the outbox ([`crate::sqlite::establish`]) on the
/// blocking pool, within the connect timeout; a file that does not exist is refused
/// ([`sqlite_file_exists`]), not made.
#[cfg(feature = "sqlite")]
pub(crate) async fn connect_sqlite(
    database_url: &str,
    limits: Limits,
) -> Result<diesel::sqlite::SqliteConnection, ConnectError> {
    let url = database_url.to_owned();
    let setup = async move {
        tokio::task::spawn_blocking(move || {
            sqlite_file_exists(&url)?;
            crate::sqlite::establish(&url).map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())?
    };
    within_connect_timeout(database_url, limits.connect_timeout, setup).await
}

/// A time stored as microseconds since the Unix epoch (as every backend's operator queries
/// read them), or an error that names `column` (`table.column`) when out of `time`'s range.
pub(crate) fn time_from_micros(us: i64, column: &str) -> diesel::QueryResult<time::OffsetDateTime> {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(us) * 1_000).map_err(|e| {
        diesel::result::Error::DeserializationError(format!("{column} is out of range: {e}").into())
    })
}

/// Runs `query` within `limit`; on timeout the caller must drop the connection, whose state
/// is unknown.
pub(crate) async fn bounded<T, E>(
    limit: Duration,
    target: &str,
    operation: &'static str,
    query: impl Future<Output = Result<T, E>>,
) -> Result<T, Bounded<E>> {
    match tokio::time::timeout(limit, query).await {
        Ok(result) => result.map_err(Bounded::Failed),
        Err(_) => Err(Bounded::TimedOut(TimedOut {
            target: target.to_owned(),
            operation,
            after: limit,
        })),
    }
}

/// [`bounded`], for a statement that sets up a connection just opened: its failure is a
/// [`ConnectError`] naming `target` and `operation` (which a timeout names already).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) async fn bounded_setup<T, E: fmt::Display>(
    limit: Duration,
    target: &str,
    operation: &'static str,
    query: impl Future<Output = Result<T, E>>,
) -> Result<T, ConnectError> {
    bounded(limit, target, operation, query)
        .await
        .map_err(|error| ConnectError {
            target: target.to_owned(),
            reason: match error {
                Bounded::Failed(error) => format!("{operation}: {error}"),
                Bounded::TimedOut(timed_out) => timed_out.to_string(),
            },
        })
}

/// Whether `error` is the database's refusal of a statement on one of the toolkit's own
/// tables or functions (its message names one: `outbox_...`) for a privilege the role or
/// account lacks: the kind of database whose words it has (PostgreSQL's "permission denied
/// for", MySQL's and MariaDB's "command denied to user"), and the component whose grants
/// hold that privilege ([`crate::privileges`]): the inbox's for its tables (`outbox_inbox`,
/// `outbox_inbox_...`), the service's for the others (a unit of work's, or an inbox
/// handler's, events). `None` for any other error, and for a refusal on another table (the
/// service's own).
pub(crate) fn lacking_privilege(error: &diesel::result::Error) -> Option<(Kind, &'static str)> {
    let diesel::result::Error::DatabaseError(_, information) = error else {
        return None;
    };
    let message = information.message();
    let kind = if message.starts_with("permission denied for ") {
        Kind::Postgres
    } else if message.contains(" command denied to user ") {
        Kind::Mysql
    } else {
        return None;
    };
    // PostgreSQL: "permission denied for table outbox_events"; MySQL: "... for table
    // `shop`.`outbox_events`", MariaDB: "... for table 'outbox_events'".
    let (_, object) = message.rsplit_once(" for ")?;
    if !object.contains("outbox_") {
        return None;
    }
    let who = if object.contains("outbox_inbox") {
        "inbox"
    } else {
        "service"
    };
    Some((kind, who))
}

/// What to add to `error`'s message when the database refused what the `who` (`relay` or
/// `inbox`) asked for a reason the error alone does not make plain; empty for any other
/// error:
///
/// - it takes no writes, and the `who` writes, so it needs a database that does. Recognised:
///   PostgreSQL's SQLSTATE 25006 (`read_only_sql_transaction`: a hot standby, or
///   `default_transaction_read_only` on for the database or the role); MySQL's and MariaDB's
///   error 1792 (`ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION`, a READ ONLY transaction or
///   `transaction_read_only`) and 1290 (`ER_OPTION_PREVENTS_STATEMENT`, "running with the
///   --read-only option": a replica's `read_only` or `super_read_only`), by its words, which
///   diesel does not give a kind of its own; SQLite's `SQLITE_READONLY` ("attempt to write a
///   readonly database": a file opened read-only, or one this process may not write);
/// - its role or account lacks a privilege: PostgreSQL's SQLSTATE 42501
///   (`insufficient_privilege`: "permission denied for table ..."), MySQL's and MariaDB's
///   errors 1142 and 1143 ("UPDATE command denied to user ..."), each by its words, which
///   diesel gives no kind of its own; granted by the statements `outbox grants` prints
///   ([`crate::privileges`]).
pub(crate) fn refusal_hint(error: &diesel::result::Error, kind: Kind, who: &str) -> String {
    let diesel::result::Error::DatabaseError(_, information) = error else {
        return String::new();
    };
    let message = information.message();
    if takes_no_writes(error) {
        return format!(
            ": {}, and the {who} writes the outbox's tables; give it {}",
            no_writes(kind),
            writable_target(kind)
        );
    }
    match kind {
        Kind::Postgres if message.starts_with("permission denied for ") => format!(
            ": the role the {who} logs in as lacks a privilege the {who} needs; as the \
             tables' owner, run the statements `outbox grants {who} <role>` prints"
        ),
        Kind::Mysql if message.contains(" command denied to user ") => format!(
            ": the account the {who} logs in as lacks a privilege the {who} needs; as the \
             tables' owner, run the statements `outbox grants {who} <account> --mysql \
             <database>` prints"
        ),
        _ => String::new(),
    }
}

/// Whether `error` is the database's refusal to write ([`refused_writes`]).
pub(crate) fn takes_no_writes(error: &diesel::result::Error) -> bool {
    refused_writes(error).is_some()
}

/// The database whose refusal to write `error` is, by its words ([`NO_WRITES_WORDS`]), or
/// PostgreSQL's for diesel's `ReadOnlyTransaction` in other words (a server's messages in
/// another language); `None` for any other error.
pub(crate) fn refused_writes(error: &diesel::result::Error) -> Option<Kind> {
    use diesel::result::{DatabaseErrorKind, Error};
    let Error::DatabaseError(error_kind, information) = error else {
        return None;
    };
    refused_writes_in(information.message()).or_else(|| {
        matches!(error_kind, DatabaseErrorKind::ReadOnlyTransaction).then_some(Kind::Postgres)
    })
}

/// The database whose refusal to write `text` (an error's message, or words that quote one)
/// holds the words of; `None` where it holds none.
pub(crate) fn refused_writes_in(text: &str) -> Option<Kind> {
    NO_WRITES_WORDS
        .iter()
        .find(|(words, _)| text.contains(words))
        .map(|(_, kind)| *kind)
}

/// The words of each database's refusal to write, and whose they are: PostgreSQL's SQLSTATE
/// 25006 (`read_only_sql_transaction`, "cannot execute ... in a read-only transaction"),
/// MySQL's and MariaDB's errors 1792 ("Cannot execute statement in a READ ONLY transaction.")
/// and 1290 ("... is running with the --read-only option ..."), SQLite's `SQLITE_READONLY`
/// ("attempt to write a readonly database"). diesel gives the first two the kind
/// `ReadOnlyTransaction`, the others none of their own.
const NO_WRITES_WORDS: [(&str, Kind); 4] = [
    ("in a read-only transaction", Kind::Postgres),
    ("READ ONLY transaction", Kind::Mysql),
    ("-read-only option", Kind::Mysql),
    ("readonly database", Kind::Sqlite),
];

/// That a database of `kind` takes no writes, with what makes it so: `the database takes no
/// writes (a hot standby, ...)`.
pub(crate) fn no_writes(kind: Kind) -> &'static str {
    match kind {
        Kind::Postgres => {
            "the database takes no writes (a hot standby, or default_transaction_read_only on \
             for the database or the role)"
        }
        Kind::Mysql => {
            "the database takes no writes (a replica, with read_only or super_read_only on, or \
             transaction_read_only on for the session)"
        }
        Kind::Sqlite => {
            "the database file takes no writes (opened read-only, as mode=ro, or a file or \
             directory this process may not write)"
        }
    }
}

/// What to give a component that writes, in place of a database of `kind` that takes no
/// writes: `the primary's URL`, or a SQLite file this process can write.
pub(crate) fn writable_target(kind: Kind) -> &'static str {
    match kind {
        Kind::Postgres => {
            "the primary's URL (with several hosts, target_session_attrs=read-write picks it)"
        }
        Kind::Mysql => "the primary's URL",
        Kind::Sqlite => {
            "a file this process can write, in a directory it can write (SQLite writes its \
             journal beside the file)"
        }
    }
}

/// A bounded query's failure.
#[derive(Debug)]
pub(crate) enum Bounded<E> {
    /// The query failed.
    Failed(E),
    /// It did not finish in time.
    TimedOut(TimedOut),
}

impl<E: fmt::Display> fmt::Display for Bounded<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Failed(error) => error.fmt(f),
            Self::TimedOut(timed_out) => timed_out.fmt(f),
        }
    }
}

/// A connection from diesel-async's deadpool pool that goes back to the pool only outside a
/// transaction. Get it with [`Pooled::get`] where `pool.get()` would be called, and use it as
/// the connection: it derefs to it, and [`Outbox::transaction`](crate::Outbox::transaction)
/// takes it as it takes deadpool's own guard.
///
/// Dropped while a transaction is open on it, or after a BEGIN, COMMIT or ROLLBACK of one was
/// cut off, or with its connection closed, it is taken out of the pool (deadpool's
/// `Object::take`, which makes room for a new connection) and closed: the database rolls the
/// transaction back as the session ends, at once, and frees the rows it locked. That happens
/// when a future holding a unit of work is dropped part-way: a request's timeout
/// (`tokio::time::timeout`), a web framework dropping the handler of a client that went away,
/// a `select!`; or when a panic unwinds out of a transaction. deadpool's own guard would give
/// such a connection back to the pool idle in its transaction, its locks held against every
/// other session (a unit of work of the same business rows waits on them; on SQLite every
/// writer waits on the database's write lock, and fails after its busy timeout), until the
/// pool handed it out again: diesel-async discards a connection with an open transaction only
/// when it recycles it at a later `get`, and deadpool hands out the longest idle connection
/// first (its default queue mode), so on a quiet service that can take long. Outside a transaction it goes back to the
/// pool like deadpool's guard.
///
/// The inbox gets its connections this way.
pub struct Pooled<O: DerefMut<Target: PoolableConnection>> {
    /// The pool's guard; `None` only while it is dropped.
    object: Option<O>,
    /// Takes the connection out of its pool and closes it (deadpool's `Object::take`).
    detach: fn(O),
}

impl<O: DerefMut<Target: PoolableConnection>> Deref for Pooled<O> {
    type Target = O::Target;

    fn deref(&self) -> &O::Target {
        self.object.as_ref().expect("taken only on drop")
    }
}

impl<O: DerefMut<Target: PoolableConnection>> DerefMut for Pooled<O> {
    fn deref_mut(&mut self) -> &mut O::Target {
        self.object.as_mut().expect("taken only on drop")
    }
}

impl<O: DerefMut<Target: PoolableConnection>> Drop for Pooled<O> {
    fn drop(&mut self) {
        if let Some(mut object) = self.object.take()
            // Its transaction manager says whether a transaction is open or a statement of
            // one (BEGIN, COMMIT, ROLLBACK) was cut off; a closed connection is broken too.
            && object.is_broken()
        {
            (self.detach)(object);
        }
    }
}

/// Shows no more than that it is one: a connection's fields are the driver's, and may hold
/// what was used to open it.
impl<O: DerefMut<Target: PoolableConnection>> fmt::Debug for Pooled<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pooled").finish_non_exhaustive()
    }
}

impl<O: DerefMut<Target: PoolableConnection>> Pooled<O> {
    /// A connection from `pool` (diesel-async's deadpool pool of an `AsyncPgConnection`, an
    /// `AsyncMysqlConnection` or an `AsyncSqliteConnection`), as `pool.get()` hands it out,
    /// in a guard that closes it rather than give it back to the pool inside a transaction
    /// (see [`Pooled`]).
    ///
    /// # Errors
    /// deadpool's `PoolError` (diesel-async's `pooled_connection::deadpool::PoolError`), as
    /// `pool.get()` returns it: its wait timed out, a new connection could not be opened, or
    /// the pool was closed.
    pub async fn get<P: sealed::Pool<Object = O>>(
        pool: &P,
    ) -> Result<Self, diesel_async::pooled_connection::deadpool::PoolError> {
        let object = pool.get().await?;
        Ok(Self {
            object: Some(object),
            detach: P::take,
        })
    }
}

mod sealed {
    use std::future::Future;
    use std::ops::DerefMut;

    use diesel_async::pooled_connection::PoolableConnection;
    use diesel_async::pooled_connection::deadpool::PoolError;

    /// diesel-async's deadpool pool of a connection the toolkit runs on. deadpool's `get` and
    /// `Object::take` need bounds of its manager that each connection type meets on its own,
    /// so each pool is named here. Public in a private module: it cannot be named or
    /// implemented outside the crate.
    pub trait Pool {
        type Object: DerefMut<Target: PoolableConnection>;

        fn get(&self) -> impl Future<Output = Result<Self::Object, PoolError>> + Send;

        /// Takes `object` out of its pool and closes its connection.
        fn take(object: Self::Object);
    }

    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    macro_rules! pool {
        ($conn:ty) => {
            impl Pool for diesel_async::pooled_connection::deadpool::Pool<$conn> {
                type Object = diesel_async::pooled_connection::deadpool::Object<$conn>;

                async fn get(&self) -> Result<Self::Object, PoolError> {
                    diesel_async::pooled_connection::deadpool::Pool::get(self).await
                }

                fn take(object: Self::Object) {
                    drop(diesel_async::pooled_connection::deadpool::Object::take(
                        object,
                    ));
                }
            }
        };
    }

    #[cfg(feature = "postgres")]
    pool!(diesel_async::AsyncPgConnection);
    #[cfg(feature = "mysql")]
    pool!(diesel_async::AsyncMysqlConnection);
    #[cfg(feature = "sqlite")]
    pool!(crate::sqlite::AsyncSqliteConnection);
}

#[cfg(test)]
mod kind_tests {
    use super::{Kind, ParseKindError};

    #[test]
    fn a_relay_refuses_another_databases_url_naming_the_relay_to_use() {
        assert_eq!(Kind::of("postgres://a@h/d"), Kind::Postgres);
        assert_eq!(Kind::of("host=h dbname=d"), Kind::Postgres);
        assert_eq!(Kind::of("mysql://root@h/d"), Kind::Mysql);
        assert_eq!(Kind::of("orders.db"), Kind::Sqlite);
        assert_eq!(Kind::of("sqlite:///var/o.db"), Kind::Sqlite);
        assert_eq!(Kind::of("file:o.db?mode=rwc"), Kind::Sqlite);
        assert_eq!(Kind::of("mysql://root@h/d?ssl-mode=required"), Kind::Mysql);
        let refused = [
            "postgress://a:pw@h/d",
            " redis://h",
            "pg://h/d",
            "MARIADB://h/d",
            "PostgreSQL://a:pw@h/d",
        ];
        for url in refused {
            let error = url.parse::<Kind>().unwrap_err();
            assert_eq!(
                error,
                ParseKindError::UnknownScheme {
                    scheme: url.trim().split_once("://").unwrap().0.to_owned()
                },
                "{url}"
            );
            let refused = Kind::Postgres.check(url, "the relay").unwrap_err();
            assert!(
                refused.contains("URL names no database the outbox runs on"),
                "{refused}"
            );
            assert!(!refused.contains("pw"), "{refused}");
        }
        for url in [
            "postgres://a@h/d",
            "postgresql://a@h/d",
            "mysql://r@h/d",
            "sqlite:///o.db",
            "file:///o.db?mode=rwc",
            "file:o.db",
            "host=h dbname=d",
            "orders.db",
            "./data/a b.db",
        ] {
            assert_eq!(url.parse::<Kind>(), Ok(Kind::of(url)), "{url}");
        }
        for url in ["", " ", "\t\n"] {
            assert_eq!(url.parse::<Kind>(), Err(ParseKindError::Empty), "{url:?}");
        }
        for url in [
            "sqlite://",
            " sqlite://  ",
            "file:",
            "file:?mode=rwc",
            "file:#x",
        ] {
            let error = url.parse::<Kind>().unwrap_err();
            assert_eq!(
                error,
                ParseKindError::NoSqlitePath {
                    url: url.trim().to_owned()
                },
                "{url:?}"
            );
            assert!(error.to_string().contains("names no file"), "{error}");
            let refused = Kind::Sqlite.check(url, "the relay").unwrap_err();
            assert!(refused.contains("names no file"), "{refused}");
        }
        assert!(Kind::Postgres.check("postgresql://a@h/d", "Relay").is_ok());
        let error = Kind::Postgres
            .check("mysql://root:s3cret@h/d", "Relay")
            .unwrap_err();
        assert_eq!(
            error,
            "database_url mysql://root@h/d is a MySQL URL, which Relay does not work on: \
             use outbox_runtime::mysql::MysqlRelay (feature `mysql`)"
        );
        let error = Kind::Sqlite
            .check("postgres://a@h/d", "SqliteRelay")
            .unwrap_err();
        assert!(error.contains("use outbox_runtime::Relay"), "{error}");
        let error = Kind::Mysql.check("orders.db", "MysqlRelay").unwrap_err();
        assert!(error.contains("is a SQLite file"), "{error}");
        let error = Kind::Mysql.check(" ", "MysqlRelay").unwrap_err();
        assert!(error.starts_with("database_url is empty"), "{error}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sqlite_url_names_the_file_sqlite_opens() {
        use std::path::PathBuf;
        for (url, file) in [
            ("orders.db", Some("orders.db")),
            ("  /var/lib/orders.db ", Some("/var/lib/orders.db")),
            ("sqlite:///var/lib/orders.db", Some("/var/lib/orders.db")),
            ("file:orders.db", Some("orders.db")),
            (
                "file:/var/lib/orders.db?mode=rw&cache=shared",
                Some("/var/lib/orders.db"),
            ),
            ("file:///var/lib/orders.db", Some("/var/lib/orders.db")),
            (
                "file://localhost/var/lib/orders.db#part",
                Some("/var/lib/orders.db"),
            ),
            ("file:data%3Fone%23two.db", Some("data?one#two.db")),
            // No file: SQLite refuses another host, and opens these in memory or not at all.
            ("file://db.internal/var/lib/orders.db", None),
            (":memory:", None),
            ("file::memory:?cache=shared", None),
            ("file:orders.db?cache=shared&mode=memory", None),
            ("", None),
            ("sqlite://", None),
            ("file:?mode=rwc", None),
        ] {
            assert_eq!(sqlite_file(url), file.map(PathBuf::from), "{url:?}");
        }
    }

    /// Why a connection failed, as the driver's cause says it: an option with a bad value, a
    /// server that refuses; never a password. (Before, "invalid connection string" and
    /// "error connecting to server" alone.)
    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn a_failed_connection_says_what_is_wrong_and_never_the_password() {
        let limits = Limits {
            connect_timeout: Duration::from_secs(10),
            statement_timeout: Duration::from_secs(10),
        };
        for (url, says) in [
            (
                "postgres://u:s3cret@127.0.0.1:5432/db?sslmode=bogus",
                "invalid connection string: invalid value for option `sslmode`",
            ),
            (
                "postgres://u:s3cret@127.0.0.1:5432/db?sslmod=require",
                "invalid connection string: unknown option `sslmod`",
            ),
            (
                "host=127.0.0.1 port=none user=u password=s3cret",
                "invalid connection string: invalid value for option `port`",
            ),
            // Port 1 on loopback: nothing listens there.
            (
                "postgres://u:s3cret@127.0.0.1:1/db",
                "error connecting to server: Connection refused (os error 111)",
            ),
            // A parse error that quotes the string ("expected `=` but got `s`", the password's
            // first letter) is shown without its cause.
            (
                "host=127.0.0.1 user=u password s3cret",
                "at <a database URL that does not parse>: invalid connection string",
            ),
        ] {
            let Err(error) =
                connect(url, None, "outbox-test", limits, Isolation::Default, None).await
            else {
                panic!("{url} connected");
            };
            let shown = error.to_string();
            assert!(shown.ends_with(says), "{url}: {shown}");
            assert!(!shown.contains("s3cret"), "{url}: {shown}");
        }
    }

    /// `redacted(url)` is `shown`, and holds no password.
    fn shows(url: &str, shown: &str) {
        let text = redacted(url);
        assert_eq!(text, shown, "{url}");
        assert!(
            !text.contains("s3cret") && !text.contains("p%40ss"),
            "{text}"
        );
    }

    #[test]
    #[cfg(feature = "postgres")]
    fn postgresql_urls_and_connection_strings_lose_their_password() {
        for (url, shown) in [
            (
                "postgres://app:s3cret@db:5433/orders",
                "postgres://app@db:5433/orders",
            ),
            (
                "postgresql://app:s3cret@db/orders",
                "postgres://app@db/orders",
            ),
            (
                "postgres://postgres@127.0.0.1:5432/test",
                "postgres://postgres@127.0.0.1/test",
            ),
            (
                "postgres://a:p%40ss@h1:1,h2:2/d",
                "postgres://a@h1:1,h2:2/d",
            ),
            (
                "host=db port=6000 user=app password=s3cret dbname=orders",
                "postgres://app@db:6000/orders",
            ),
            ("postgres://a:s3cret@h/d?password=other", "postgres://a@h/d"),
            // A service file's section, named.
            (
                "postgres://a:s3cret@h/d?service=orders&sslmode=require",
                "postgres://a@h/d?service=orders",
            ),
            (
                "service=orders password=s3cret",
                "postgres://?service=orders",
            ),
            // TLS options tokio-postgres does not know, a missing authority file included.
            (
                "postgres://a:s3cret@h/d?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
                "postgres://a@h/d",
            ),
            (
                "host=h user=a password=s3cret dbname=d sslmode=verify-ca",
                "postgres://a@h/d",
            ),
            (
                "postgres://[not a url",
                "<a database URL that does not parse>",
            ),
        ] {
            shows(url, shown);
        }
        assert_eq!(
            format!("{:?}", Redacted("postgres://a:s3cret@h/d")),
            "\"postgres://a@h/d\""
        );
    }

    /// Without the `postgres` feature there is no tokio-postgres to parse its URLs: they are
    /// shown as MySQL's are, and a connection string not at all.
    #[test]
    #[cfg(not(feature = "postgres"))]
    fn postgresql_urls_lose_their_password_without_the_postgres_feature() {
        for (url, shown) in [
            (
                "postgres://app:s3cret@db:5433/orders",
                "postgres://app@db:5433/orders",
            ),
            (
                "postgresql://app:s3cret/x@db/orders?sslmode=require",
                "postgresql://app@db/orders",
            ),
            (
                "host=db user=app password=s3cret dbname=orders",
                "<a database URL that does not parse>",
            ),
        ] {
            shows(url, shown);
        }
    }

    #[test]
    fn mysql_urls_and_sqlite_paths_lose_their_password() {
        for (url, shown) in [
            (
                "mysql://root:s3cret@127.0.0.1:3306/test?ssl-mode=required",
                "mysql://root@127.0.0.1:3306/test",
            ),
            ("mysql://root@127.0.0.1/test", "mysql://root@127.0.0.1/test"),
            ("mysql://db.internal", "mysql://db.internal/"),
            // A password with the characters a URL reserves, written raw.
            ("mysql://app:s3cret/x@db/orders", "mysql://app@db/orders"),
            ("mysql://app:s3cret?x#y@db/orders", "mysql://app@db/orders"),
            ("sqlite:///var/lib/o.db", "sqlite:///var/lib/o.db"),
            ("file:o.db?mode=rwc&vfs=x", "file:o.db"),
            ("orders.db", "orders.db"),
            ("user:s3cret@host", "<a database URL that does not parse>"),
        ] {
            shows(url, shown);
        }
    }
}
