//! Roles and grants: the privileges each part of the outbox needs, for deployments where one
//! role or account runs the migrations and owns the tables, and the service, the relay and
//! the inbox each log in as one of their own that holds only what it uses.
//!
//! [`grants`] writes PostgreSQL's `GRANT` statements for one [`Component`] and role,
//! [`mysql_grants`] MySQL's and MariaDB's for an account (the `outbox grants` command prints
//! either). The relay and the inbox check at connect that their role or account holds what
//! they need, and stop with a [`ConnectError`](crate::ConnectError) that names each
//! privilege missing and the command that writes the grants, where they would otherwise
//! start and fail on their first batch or message ("permission denied for table ...",
//! "UPDATE command denied to user ...") for as long as they ran. On PostgreSQL the check is
//! one query of the server's privilege functions; MySQL has none, so there each privilege is
//! tried by a statement that touches no row, in a transaction rolled back.
//!
//! Two operations stay with the tables' owner on PostgreSQL, because it lets no grant give
//! them: the migrations (they create and alter tables), and dropping the archive's days
//! ([`drop_archived`](crate::outbox::drop_archived), from `outbox purge` or the relay's
//! `--purge-older-than` in `--published archive`), since only a table's owner may detach a
//! partition and drop it (PostgreSQL 15 docs, ALTER TABLE and DROP TABLE). Creating the
//! archive's days needs no ownership: `outbox_published_create_partitions` runs as its owner
//! (a `SECURITY DEFINER` function, granted to the relay). On MySQL the archive is one table,
//! whose old rows the relay's retention deletes (`DELETE` is in its grants).

use std::fmt::{self, Write as _};
use std::str::FromStr;

use crate::outbox::PublishedRows;

/// A part of the outbox that connects to its tables, each as a role of its own if you like.
///
/// (The variants are not named as the crate's types, `UnitOfWork`, `Relay`, `Inbox`: rustc
/// writes a type's bare name in its diagnostics only while no other public item bears it,
/// and a variant of that name made every error about a unit of work say
/// `outbox_runtime::UnitOfWork`, as `ui-tests/unit_of_work` showed.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Component {
    /// A service that commits units of work with events
    /// ([`Outbox::transaction`](crate::Outbox::transaction)): it inserts events, numbers
    /// them per aggregate, takes dedup keys and registers its topology. An inbox handler that
    /// commits events needs these too.
    Service,
    /// The message relay, in each [`PublishedRows`] mode: it claims, marks, deletes and
    /// archives rows, dead-letters them, and registers its topology.
    MessageRelay,
    /// An inbox consumer: it records messages, positions, attempts, gaps and dead letters,
    /// and deletes its old rows. Its handlers' own tables need their own grants.
    InboxConsumer,
    /// The `outbox` command's operator commands: `status`, `dead-letters`, `retry`, `skip`,
    /// `inbox-dead-letters`, `purge` (but dropping the archive's days: see the module) and
    /// `replay`.
    Operator,
}

impl Component {
    /// Every component, in the order above.
    pub const ALL: [Self; 4] = [
        Self::Service,
        Self::MessageRelay,
        Self::InboxConsumer,
        Self::Operator,
    ];

    /// Its name in the `outbox grants` command: `service`, `relay`, `inbox`,
    /// `operator`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Service => "service",
            Self::MessageRelay => "relay",
            Self::InboxConsumer => "inbox",
            Self::Operator => "operator",
        }
    }

    /// What it needs: the union over the relay's modes.
    fn needs(self) -> Vec<Need> {
        match self {
            Self::Service => service_needs(),
            Self::MessageRelay => relay_needs(None),
            Self::InboxConsumer => inbox_needs(),
            Self::Operator => operator_needs(),
        }
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What to add to a database error's message when the database refused one of
/// `component`'s statements on the outbox's own tables or functions (its message names one,
/// `outbox_...`) for a privilege the role lacks: for the operator, ": the role the operator
/// logs in as lacks a privilege the operator needs; as the tables' owner, run the statements"
/// that `outbox grants operator` prints for the role (on MySQL, for the account, with
/// `--mysql` and the database); or refused a write because it takes none (a hot standby, a
/// replica, a SQLite file opened read-only): ": the database takes no writes (...), and the
/// operator writes the outbox's tables; give it the primary's URL". `None` for any other
/// error. Recognised by the server's words, which diesel gives no kind of its own:
/// PostgreSQL's "permission denied for" (SQLSTATE 42501), MySQL's and MariaDB's "command
/// denied to user" (errors 1142, 1143); for a write refused, as the relay and the inbox
/// recognise it (PostgreSQL's SQLSTATE 25006, MySQL's errors 1792 and 1290, SQLite's
/// `SQLITE_READONLY`).
///
/// The relay, the inbox and the unit of work ([`UnitOfWorkError::MissingPrivilege`]) add it
/// themselves; this is for a program's own calls of the operator's functions.
///
/// [`UnitOfWorkError::MissingPrivilege`]: crate::UnitOfWorkError::MissingPrivilege
pub fn refusal_hint(error: &diesel::result::Error, component: Component) -> Option<String> {
    let kind = match crate::database::lacking_privilege(error) {
        Some((kind, _)) => kind,
        None => crate::database::refused_writes(error)?,
    };
    Some(crate::database::refusal_hint(error, kind, component.name()))
}

/// A name that is not one of [`Component::name`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no component is called {0:?}: the components are service, relay, inbox and operator")]
pub struct UnknownComponent(pub String);

impl FromStr for Component {
    type Err = UnknownComponent;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|component| component.name() == name)
            .ok_or_else(|| UnknownComponent(name.to_owned()))
    }
}

/// A role, schema, account or database name that the database would not take as given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the {what} name {name:?} {fault}")]
pub struct InvalidName {
    /// `role` or `schema` (PostgreSQL), `account` or `database` (MySQL).
    pub what: &'static str,
    /// The name as given.
    pub name: String,
    /// Why it is refused.
    pub fault: &'static str,
}

/// The longest identifier PostgreSQL keeps whole, in bytes: `NAMEDATALEN` - 1 (PostgreSQL 15
/// docs, 4.1.1 "Identifiers and Key Words"); it cuts longer ones short, so a grant would name
/// another role.
pub const MAX_IDENTIFIER_BYTES: usize = 63;

/// `name` as a quoted identifier: in double quotes, each double quote doubled (PostgreSQL 15
/// docs, 4.1.1), so it is taken exactly as given, case and all.
fn quoted(what: &'static str, name: &str) -> Result<String, InvalidName> {
    let fault = if name.is_empty() {
        Some("is empty")
    } else if name.len() > MAX_IDENTIFIER_BYTES {
        Some("is longer than PostgreSQL's 63 bytes (it would cut it short, and name another)")
    } else if name.contains('\0') {
        Some("holds a NUL character, which PostgreSQL's names cannot")
    } else {
        None
    };
    match fault {
        Some(fault) => Err(InvalidName {
            what,
            name: name.to_owned(),
            fault,
        }),
        None => Ok(format!("\"{}\"", name.replace('"', "\"\""))),
    }
}

/// The `GRANT` statements that give `role` what `component` needs on the outbox's tables and
/// functions in `schema` (`public` where you did not choose one), one per line, with a first
/// comment line naming the component; for a migration of your own, or `psql`. Run them as
/// the tables' owner, after the outbox's migrations (and again after an upgrade that adds
/// a table or function: the statements name those of this version). For the relay, they
/// cover every [`PublishedRows`] mode.
///
/// Names are quoted, so they are taken exactly as given (`Relay` is not `relay`).
///
/// # Errors
/// [`InvalidName`] for a `role` or `schema` that is empty, longer than
/// [`MAX_IDENTIFIER_BYTES`] or holds a NUL.
pub fn grants(component: Component, role: &str, schema: &str) -> Result<String, InvalidName> {
    let role = quoted("role", role)?;
    let schema = quoted("schema", schema)?;
    let mut sql = format!(
        "-- What the outbox's {component} needs (outbox-runtime {}).\n\
         GRANT USAGE ON SCHEMA {schema} TO {role};\n",
        env!("CARGO_PKG_VERSION")
    );
    for (object, privileges) in by_object(component.needs()) {
        let (kind, name) = match object {
            Object::Table(name) => ("TABLE", name),
            Object::Function(name) => ("FUNCTION", name),
        };
        let _ = writeln!(
            sql,
            "GRANT {} ON {kind} {schema}.\"{name}\" TO {role};",
            privileges.join(", ")
        );
    }
    Ok(sql)
}

/// The `GRANT` statements that give the MySQL or MariaDB `account` what `component` needs on
/// the outbox's tables in `database`, one per line, with a first comment line naming the
/// component; run them as the tables' owner (or an account with `GRANT OPTION` on them),
/// after the outbox's MySQL migrations, and again after an upgrade that adds a table. MySQL
/// has neither the functions nor the topology registry of PostgreSQL, so the statements name
/// tables only; for the relay they cover every [`PublishedRows`] mode, and in Archive mode
/// also `SELECT` and `DELETE` on `outbox_published`, whose old rows the relay's retention
/// deletes (`--purge-older-than`).
///
/// `account` is `name`, written `'name'` (MySQL reads `'name'@'%'`: any host; a MariaDB role
/// has no host part), or `name@host`, split at its last `@` and written `'name'@'host'`
/// (MySQL 8.0 docs, 8.2.4 "Specifying Account Names"). Names are quoted, a single quote
/// doubled and the database's backtick doubled, so each is taken exactly as given.
///
/// # Errors
/// [`InvalidName`] for an account whose name or host is empty, or that holds a NUL or a
/// backslash (which MySQL reads as an escape or not by `sql_mode`,
/// `NO_BACKSLASH_ESCAPES`), and for a `database` that is empty or holds a NUL.
pub fn mysql_grants(
    component: Component,
    account: &str,
    database: &str,
) -> Result<String, InvalidName> {
    let account = mysql_account(account)?;
    let database = match database {
        "" => Some("is empty"),
        name if name.contains('\0') => Some("holds a NUL character, which MySQL's names cannot"),
        _ => None,
    }
    .map_or_else(
        || Ok(format!("`{}`", database.replace('`', "``"))),
        |fault| {
            Err(InvalidName {
                what: "database",
                name: database.to_owned(),
                fault,
            })
        },
    )?;
    let mut sql = format!(
        "-- What the outbox's {component} needs on MySQL or MariaDB (outbox-runtime {}).\n",
        env!("CARGO_PKG_VERSION")
    );
    for (object, privileges) in by_object(mysql_needs(component, None)) {
        let _ = writeln!(
            sql,
            "GRANT {} ON {database}.`{}` TO {account};",
            privileges.join(", "),
            object.name()
        );
    }
    Ok(sql)
}

/// A MySQL account as [`mysql_grants`] takes it, quoted.
fn mysql_account(account: &str) -> Result<String, InvalidName> {
    let (name, host) = match account.rsplit_once('@') {
        Some((name, host)) => (name, Some(host)),
        None => (account, None),
    };
    let fault = if name.is_empty() {
        Some("has an empty user name (MySQL's anonymous user)")
    } else if host == Some("") {
        Some("has an empty host after its `@` (leave the `@` out for any host)")
    } else if account.contains('\0') {
        Some("holds a NUL character, which MySQL's names cannot")
    } else if account.contains('\\') {
        Some(
            "holds a backslash, which MySQL reads as an escape or not by its sql_mode \
             (NO_BACKSLASH_ESCAPES)",
        )
    } else {
        None
    };
    if let Some(fault) = fault {
        return Err(InvalidName {
            what: "account",
            name: account.to_owned(),
            fault,
        });
    }
    let literal = |text: &str| format!("'{}'", text.replace('\'', "''"));
    Ok(match host {
        Some(host) => format!("{}@{}", literal(name), literal(host)),
        None => literal(name),
    })
}

/// `needs` grouped by object, in the order each object first comes, its privileges in the
/// order listed: one statement per object.
fn by_object(needs: Vec<Need>) -> Vec<(Object, Vec<&'static str>)> {
    let mut objects: Vec<(Object, Vec<&str>)> = Vec::new();
    for need in needs {
        match objects
            .iter_mut()
            .find(|(object, _)| *object == need.object)
        {
            Some((_, privileges)) => privileges.push(need.privilege),
            None => objects.push((need.object, vec![need.privilege])),
        }
    }
    objects
}

/// Why [`check`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrivilegeError {
    /// The role or account lacks privileges the component needs: a sentence naming it, each
    /// privilege as `UPDATE on outbox_events`, and the `outbox grants` command that writes
    /// the grants (the relay's and the inbox's connect error says the same).
    #[error("{0}")]
    Missing(String),
    /// The check's own statements failed.
    #[error("checking the privileges: {0}")]
    Database(#[from] diesel::result::Error),
}

/// A connection whose role's privileges [`check`] reads: diesel-async's PostgreSQL and MySQL
/// connections (SQLite has no roles). Sealed.
pub trait PrivilegedConnection: Send + sealed::Sealed {
    #[doc(hidden)]
    fn lacking_for(
        &mut self,
        component: Component,
    ) -> impl std::future::Future<Output = diesel::QueryResult<Option<String>>> + Send;
}

mod sealed {
    pub trait Sealed {}
}

#[cfg(feature = "postgres")]
impl sealed::Sealed for diesel_async::AsyncPgConnection {}

#[cfg(feature = "postgres")]
impl PrivilegedConnection for diesel_async::AsyncPgConnection {
    async fn lacking_for(&mut self, component: Component) -> diesel::QueryResult<Option<String>> {
        lacking(self, component, &component.needs()).await
    }
}

#[cfg(feature = "mysql")]
impl sealed::Sealed for diesel_async::AsyncMysqlConnection {}

#[cfg(feature = "mysql")]
impl PrivilegedConnection for diesel_async::AsyncMysqlConnection {
    async fn lacking_for(&mut self, component: Component) -> diesel::QueryResult<Option<String>> {
        lacking_on_mysql(self, component, &mysql_needs(component, None)).await
    }
}

/// Checks that the connection's role (PostgreSQL) or account (MySQL) holds every privilege
/// that `component` needs, as [`grants`] and [`mysql_grants`] give them (for the relay, in
/// every [`PublishedRows`] mode), the check the relay and the inbox run at connect: for a
/// service, whose units of work check nothing before their first, to stop at start rather
/// than fail its first unit of work with "permission denied"; or to try a role's grants
/// before deploying it (`outbox grants <component> --check`). A table the database lacks is
/// not counted: that is the migrations' check
/// ([`pending_migrations`](crate::pending_migrations)).
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn run(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_runtime::privileges::{self, Component};
/// privileges::check(conn, Component::Service).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`PrivilegeError::Missing`] naming what it lacks, or [`PrivilegeError::Database`].
pub async fn check<C: PrivilegedConnection>(
    conn: &mut C,
    component: Component,
) -> Result<(), PrivilegeError> {
    match conn.lacking_for(component).await? {
        None => Ok(()),
        Some(missing) => Err(PrivilegeError::Missing(missing)),
    }
}

/// A table or function of the outbox, by its unquoted name (found along the `search_path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Object {
    Table(&'static str),
    Function(&'static str),
}

impl Object {
    fn name(self) -> &'static str {
        match self {
            Self::Table(name) | Self::Function(name) => name,
        }
    }
}

/// One privilege on one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Need {
    object: Object,
    privilege: &'static str,
}

fn table(name: &'static str, privilege: &'static str) -> Need {
    Need {
        object: Object::Table(name),
        privilege,
    }
}

fn execute(name: &'static str) -> Need {
    Need {
        object: Object::Function(name),
        privilege: "EXECUTE",
    }
}

/// Every component reads which migrations ran (the relay and the inbox at connect, a unit
/// of work after a database error, the `outbox` command before each command).
fn migrations_table() -> Need {
    table("__diesel_schema_migrations", "SELECT")
}

/// `privileges` on each of `tables`.
fn each(tables: &[&'static str], privileges: &[&'static str]) -> Vec<Need> {
    tables
        .iter()
        .flat_map(|name| privileges.iter().map(|privilege| table(name, privilege)))
        .collect()
}

/// The unit of work and the relay register their topology (`outbox_register_topology`
/// upserts its row and deletes rows unseen for 30 days).
fn topology() -> Vec<Need> {
    let mut needs = each(
        &["outbox_topologies"],
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
    );
    needs.push(execute("outbox_register_topology"));
    needs
}

fn service_needs() -> Vec<Need> {
    let mut needs = vec![migrations_table()];
    // The next sequence reads the aggregate's highest; the rows are inserted.
    needs.extend(each(&["outbox_events"], &["SELECT", "INSERT"]));
    // Upserted, locked until COMMIT, read back (blocked_until).
    needs.extend(each(
        &["outbox_aggregates"],
        &["SELECT", "INSERT", "UPDATE"],
    ));
    needs.extend(each(&["outbox_dedup_keys"], &["SELECT", "INSERT"]));
    needs.push(execute("outbox_insert_events"));
    needs.push(execute("outbox_assert_unit_of_work"));
    needs.extend(topology());
    needs
}

/// What the relay needs in `mode`, or in every mode.
pub(crate) fn relay_needs(mode: Option<PublishedRows>) -> Vec<Need> {
    let mut needs = vec![migrations_table()];
    // Claimed FOR UPDATE, marked, dead-lettered and rescheduled by UPDATE; deleted in Delete
    // mode, moved (a DELETE) in Archive mode, purged by `--purge-older-than` in Mark mode.
    needs.extend(each(&["outbox_events"], &["SELECT", "UPDATE", "DELETE"]));
    // An aggregate blocked behind a dead letter, and unblocked.
    needs.extend(each(&["outbox_aggregates"], &["SELECT", "UPDATE"]));
    needs.extend(topology());
    if matches!(mode, None | Some(PublishedRows::Archive)) {
        needs.push(table("outbox_published", "INSERT"));
        needs.extend([
            execute("outbox_archive_published"),
            execute("outbox_published_partitions"),
            execute("outbox_published_create_partitions"),
        ]);
    }
    needs
}

/// The inbox's own tables.
const INBOX_TABLES: [&str; 5] = [
    "outbox_inbox",
    "outbox_inbox_positions",
    "outbox_inbox_attempts",
    "outbox_inbox_gaps",
    "outbox_inbox_dead_letters",
];

fn inbox_needs() -> Vec<Need> {
    let mut needs = vec![migrations_table()];
    // Recorded, read, updated, and deleted by retention.
    needs.extend(each(
        &INBOX_TABLES,
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
    ));
    needs.extend([
        execute("outbox_inbox_record"),
        execute("outbox_inbox_finish"),
        execute("outbox_assert_unit_of_work"),
    ]);
    needs
}

fn operator_needs() -> Vec<Need> {
    let mut needs = vec![migrations_table()];
    // `status` reads; `retry` and `skip` update a dead letter, the rows behind it and its
    // aggregate; `purge` deletes published rows, archived rows (MySQL, SQLite) and dedup keys;
    // `replay` reads the archive.
    needs.extend(each(&["outbox_events"], &["SELECT", "UPDATE", "DELETE"]));
    needs.extend(each(&["outbox_aggregates"], &["SELECT", "UPDATE"]));
    needs.extend(each(
        &["outbox_published", "outbox_dedup_keys"],
        &["SELECT", "DELETE"],
    ));
    // `inbox-dead-letters` reads and discards; `purge` deletes the inbox's old rows.
    needs.extend(each(&INBOX_TABLES, &["SELECT", "DELETE"]));
    needs
}

/// What `component` needs on MySQL, in `mode`, or (`None`) all that [`mysql_grants`] gives:
/// the tables of PostgreSQL's list that MySQL has (no functions, no topology registry), and
/// for the relay, with `None`, `SELECT` and `DELETE` on `outbox_published` too: MySQL's
/// archive is one table whose old rows the relay's retention (`--purge-older-than`) deletes,
/// where PostgreSQL's owner drops a day; a relay without retention does without them.
pub(crate) fn mysql_needs(component: Component, mode: Option<PublishedRows>) -> Vec<Need> {
    let needs = match component {
        Component::MessageRelay => relay_needs(mode),
        other => other.needs(),
    };
    let mut needs: Vec<Need> = needs
        .into_iter()
        .filter(|need| matches!(need.object, Object::Table(name) if name != "outbox_topologies"))
        .collect();
    if component == Component::Service {
        // A dedup key is taken by `INSERT ... ON DUPLICATE KEY UPDATE`, for which the server
        // asks UPDATE too, even where the key is new (MariaDB 10.11 refused the first key
        // without it).
        let at = needs
            .iter()
            .rposition(|need| need.object == Object::Table("outbox_dedup_keys"))
            .map_or(needs.len(), |last| last + 1);
        needs.insert(at, table("outbox_dedup_keys", "UPDATE"));
    }
    if component == Component::MessageRelay && mode.is_none() {
        needs.extend(each(&["outbox_published"], &["SELECT", "DELETE"]));
    }
    needs
}

/// The privileges of `needs` that the connection's role lacks (held directly, through a role
/// it is a member of, or by PUBLIC), as `UPDATE on outbox_events`, in the order of `needs`,
/// after `USAGE` on a schema of its `search_path` that holds the tables and that it may not
/// use;
/// then a sentence for a [`ConnectError`](crate::ConnectError) naming them, the role and the
/// grants `component` needs, or `None` when it lacks none. An object the `search_path` does
/// not find is left to the migrations check.
///
/// One query of `has_table_privilege` and `has_function_privilege` (PostgreSQL 15 docs, 9.26
/// "System Information Functions and Operators", "Access Privilege Inquiry Functions").
#[cfg(feature = "postgres")]
pub(crate) async fn lacking(
    conn: &mut diesel_async::AsyncPgConnection,
    component: Component,
    needs: &[Need],
) -> diesel::QueryResult<Option<String>> {
    use diesel::QueryableByName;
    use diesel::sql_types::{Array, Text};
    use diesel_async::RunQueryDsl;

    #[derive(QueryableByName)]
    struct Lacking {
        #[diesel(sql_type = Text)]
        role: String,
        #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
        schema: Option<String>,
        #[diesel(sql_type = Array<Text>)]
        hidden: Vec<String>,
        #[diesel(sql_type = Array<Text>)]
        missing: Vec<String>,
    }
    let (kinds, (objects, privileges)): (Vec<&str>, (Vec<&str>, Vec<&str>)) = needs
        .iter()
        .map(|need| match need.object {
            Object::Table(name) => ("table", (name, need.privilege)),
            Object::Function(name) => ("function", (name, need.privilege)),
        })
        .unzip();
    // The schema the grants name: that of the component's first table (after diesel's).
    let anchor = needs
        .iter()
        .find_map(|need| match need.object {
            Object::Table(name) if name != "__diesel_schema_migrations" => Some(name),
            _ => None,
        })
        .unwrap_or("outbox_events");
    let row: Lacking = diesel::sql_query(LACKING)
        .bind::<Array<Text>, _>(kinds)
        .bind::<Array<Text>, _>(objects)
        .bind::<Array<Text>, _>(privileges)
        .bind::<Text, _>(anchor)
        .get_result(conn)
        .await?;
    if row.missing.is_empty() && row.hidden.is_empty() {
        return Ok(None);
    }
    let missing: Vec<String> = row
        .hidden
        .iter()
        .map(|schema| format!("USAGE on schema {schema}"))
        .chain(row.missing)
        .collect();
    let schema = match row
        .schema
        .as_deref()
        .or(<[String]>::first(&row.hidden).map(String::as_str))
    {
        None | Some("public") => String::new(),
        Some(schema) => format!(" --schema {}", shell_word(schema)),
    };
    Ok(Some(format!(
        "the role {:?} lacks {}, which the {component} needs; as the tables' owner, run the \
         statements `outbox grants {component} {}{schema}` prints \
         (outbox_runtime::privileges::grants)",
        row.role,
        missing.join(", "),
        shell_word(&row.role),
    )))
}

/// The privileges of `needs` that the MySQL or MariaDB connection's account lacks (held
/// directly, through a role active in the session, or on the database or every database), as
/// `UPDATE on outbox_events`, in the order of `needs`; then a sentence naming them, the account
/// and the grants `component` needs, or `None` when it lacks none.
///
/// MySQL has no function that answers for a privilege, and its `information_schema` shows an
/// account only its own grants, not those of its roles; so each privilege is tried by a
/// statement that touches no row (`WHERE FALSE`, `LIMIT 0`), in a transaction rolled back, and
/// a try the server refuses for want of a privilege (errors 1142, 1143, 1044: MySQL docs,
/// "Server Error Message Reference") names it. The code is read by `GET DIAGNOSTICS`, which
/// MySQL permits outside a handler "to check the execution of any SQL statement" (MySQL 8.4
/// docs, 15.6.7.3; since 5.6.4, and MariaDB), not from the message, which follows the server's
/// language. A table that does not exist (1146) is left to the migrations check,
/// any other failure (a column without a default, a server that takes no writes) to the
/// checks after it: the server checks privileges first.
#[cfg(feature = "mysql")]
pub(crate) async fn lacking_on_mysql(
    conn: &mut diesel_async::AsyncMysqlConnection,
    component: Component,
    needs: &[Need],
) -> diesel::QueryResult<Option<String>> {
    use diesel::QueryableByName;
    use diesel::sql_types::Text;
    use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

    #[derive(QueryableByName)]
    struct Account {
        #[diesel(sql_type = Text)]
        account: String,
        #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
        database: Option<String>,
    }
    conn.batch_execute("START TRANSACTION").await?;
    let tried = try_each_on_mysql(conn, needs).await;
    let rolled_back = conn.batch_execute("ROLLBACK").await;
    let missing = tried?;
    rolled_back?;
    if missing.is_empty() {
        return Ok(None);
    }
    let row: Account =
        diesel::sql_query("SELECT CURRENT_USER() AS account, DATABASE() AS `database`")
            .get_result(conn)
            .await?;
    // CURRENT_USER() is `name@host`, the host after the last `@`.
    let (name, host) = row.account.rsplit_once('@').unwrap_or((&row.account, "%"));
    let argument = if host == "%" {
        name.to_owned()
    } else {
        row.account.clone()
    };
    Ok(Some(format!(
        "the account '{name}'@'{host}' lacks {}, which the {component} needs; as the tables' \
         owner, run the statements `outbox grants {component} {} --mysql {}` prints \
         (outbox_runtime::privileges::mysql_grants)",
        missing.join(", "),
        shell_word(&argument),
        shell_word(row.database.as_deref().unwrap_or("<database>")),
    )))
}

/// [`lacking_on_mysql`]'s tries, inside its transaction.
#[cfg(feature = "mysql")]
async fn try_each_on_mysql(
    conn: &mut diesel_async::AsyncMysqlConnection,
    needs: &[Need],
) -> diesel::QueryResult<Vec<String>> {
    use diesel::QueryableByName;
    use diesel::sql_types::{BigInt, Nullable};
    use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

    #[derive(QueryableByName)]
    struct Errno {
        #[diesel(sql_type = Nullable<BigInt>)]
        errno: Option<i64>,
    }
    let mut missing = Vec::new();
    for need in needs {
        let Object::Table(table) = need.object else {
            continue;
        };
        // A column each table has. The tries write no value into it and read none from it:
        // INSERT's and UPDATE's need no SELECT, and a column without a default, or NOT NULL,
        // fails them only after the privilege check, which is all they are for.
        let column = match table {
            "__diesel_schema_migrations" => "version",
            "outbox_dedup_keys" => "dedup_key",
            inbox if inbox.starts_with("outbox_inbox") => "consumer",
            _ => "aggregate_type",
        };
        let sql = match need.privilege {
            "SELECT" => format!("SELECT 1 FROM `{table}` LIMIT 0"),
            "INSERT" => {
                format!("INSERT INTO `{table}` (`{column}`) SELECT NULL FROM DUAL WHERE FALSE")
            }
            "UPDATE" => format!("UPDATE `{table}` SET `{column}` = NULL WHERE FALSE"),
            "DELETE" => format!("DELETE FROM `{table}` WHERE FALSE"),
            _ => continue,
        };
        if conn.batch_execute(&sql).await.is_ok() {
            continue;
        }
        // The refused statement's code, before another statement clears it.
        conn.batch_execute("GET DIAGNOSTICS CONDITION 1 @outbox_errno = MYSQL_ERRNO")
            .await?;
        let refused: Errno = diesel::sql_query("SELECT CAST(@outbox_errno AS SIGNED) AS errno")
            .get_result(conn)
            .await?;
        // ER_DBACCESS_DENIED_ERROR, ER_TABLEACCESS_DENIED_ERROR, ER_COLUMNACCESS_DENIED_ERROR.
        if matches!(refused.errno, Some(1044 | 1142 | 1143)) {
            missing.push(format!("{} on {table}", need.privilege));
        }
    }
    Ok(missing)
}

/// `word` as one word of a POSIX shell command: as it is when it needs no quoting, else in
/// single quotes, each single quote written `'\''`.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn shell_word(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// `$1`, `$2`, `$3`: each need's kind (`table` or `function`), object and privilege; `$4`, the
/// table whose schema to name. `hidden`: when the `search_path` finds no table `$4`, the
/// schemas it names that hold one and that the role may not use (PostgreSQL leaves them out
/// of the path without a word, and the tables seem not to exist).
#[cfg(feature = "postgres")]
const LACKING: &str = "SELECT current_user::text AS role, \
            (SELECT n.nspname::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.oid = to_regclass($4)) AS schema, \
            (SELECT coalesce(array_agg(n.nspname::text ORDER BY n.nspname), '{}') \
             FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid \
             WHERE to_regclass($4) IS NULL AND c.relname = $4 \
               AND n.nspname = ANY (SELECT btrim(p, ' \"') \
                   FROM unnest(string_to_array(current_setting('search_path'), ',')) p) \
               AND NOT has_schema_privilege(n.oid, 'USAGE')) AS hidden, \
            coalesce(array_agg(n.privilege || ' on ' || n.object ORDER BY n.i) FILTER (WHERE NOT \
                coalesce(CASE n.kind \
                    WHEN 'table' THEN has_table_privilege(to_regclass(n.object), n.privilege) \
                    ELSE has_function_privilege(to_regproc(n.object)::oid, n.privilege) \
                END, true)), '{}') AS missing \
     FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS n(kind, object, privilege, i)";

#[cfg(test)]
mod tests {
    use super::*;

    /// A write refused by a database that takes none is named with that database's causes
    /// and what to give the operator instead, whichever database's words it has; another
    /// error gets nothing. Before, only a missing privilege got a hint, and `outbox purge` on
    /// a hot standby said "database error: cannot execute SELECT in a read-only transaction".
    #[test]
    fn a_write_refused_by_a_database_that_takes_none_is_named_for_its_database() {
        use diesel::result::{DatabaseErrorKind, Error};
        let error = |kind, message: &str| Error::DatabaseError(kind, Box::new(message.to_owned()));
        for (error, says) in [
            (
                error(
                    DatabaseErrorKind::ReadOnlyTransaction,
                    "cannot execute SELECT in a read-only transaction",
                ),
                "the database takes no writes (a hot standby, or default_transaction_read_only",
            ),
            (
                error(
                    DatabaseErrorKind::ReadOnlyTransaction,
                    "Cannot execute statement in a READ ONLY transaction.",
                ),
                "the database takes no writes (a replica, with read_only",
            ),
            (
                error(
                    DatabaseErrorKind::Unknown,
                    "The MariaDB server is running with the --read-only option so it cannot \
                     execute this statement",
                ),
                "the database takes no writes (a replica, with read_only",
            ),
            (
                error(
                    DatabaseErrorKind::Unknown,
                    "attempt to write a readonly database",
                ),
                "the database file takes no writes (opened read-only",
            ),
        ] {
            let hint = refusal_hint(&error, Component::Operator).expect("a hint");
            assert!(
                hint.starts_with(&format!(": {says}"))
                    && hint.contains("and the operator writes the outbox's tables; give it "),
                "{error}: {hint}"
            );
        }
        let other = error(
            DatabaseErrorKind::Unknown,
            "relation \"orders\" does not exist",
        );
        assert_eq!(refusal_hint(&other, Component::Operator), None);
    }

    #[test]
    fn grants_name_each_object_once_in_its_schema_with_names_quoted_as_given() {
        let sql = grants(Component::MessageRelay, "Relay \"one\"", "orders").unwrap();
        let lines: Vec<&str> = sql.lines().collect();
        assert_eq!(
            lines[0],
            "-- What the outbox's relay needs (outbox-runtime 0.1.0)."
        );
        assert_eq!(
            lines[1],
            "GRANT USAGE ON SCHEMA \"orders\" TO \"Relay \"\"one\"\"\";"
        );
        assert!(lines.contains(
            &"GRANT SELECT, UPDATE, DELETE ON TABLE \"orders\".\"outbox_events\" TO \"Relay \"\"one\"\"\";"
        ));
        assert!(lines.contains(
            &"GRANT EXECUTE ON FUNCTION \"orders\".\"outbox_published_create_partitions\" TO \"Relay \"\"one\"\"\";"
        ));
        let objects: Vec<&str> = lines[2..]
            .iter()
            .map(|line| {
                line.split(" ON ")
                    .nth(1)
                    .unwrap()
                    .split(" TO ")
                    .next()
                    .unwrap()
            })
            .collect();
        let unique: std::collections::BTreeSet<&str> = objects.iter().copied().collect();
        assert_eq!(
            objects.len(),
            unique.len(),
            "one statement per object: {objects:?}"
        );
    }

    #[test]
    fn the_relay_needs_the_archive_only_to_archive() {
        let archive = |mode| {
            relay_needs(mode)
                .iter()
                .any(|need| need.object == Object::Table("outbox_published"))
        };
        assert!(archive(None));
        assert!(archive(Some(PublishedRows::Archive)));
        assert!(!archive(Some(PublishedRows::Mark)));
        assert!(!archive(Some(PublishedRows::Delete)));
        // What grants() writes covers what each mode checks.
        let all = Component::MessageRelay.needs();
        for mode in [
            PublishedRows::Delete,
            PublishedRows::Mark,
            PublishedRows::Archive,
        ] {
            for need in relay_needs(Some(mode)) {
                assert!(all.contains(&need), "{mode:?}: {need:?}");
            }
        }
    }

    #[test]
    fn a_name_postgresql_would_not_take_as_given_is_refused_naming_why() {
        let refused = |role: &str| grants(Component::InboxConsumer, role, "public").unwrap_err();
        assert_eq!(refused("").to_string(), "the role name \"\" is empty");
        assert_eq!(
            refused(&"r".repeat(64)).to_string(),
            format!(
                "the role name {:?} is longer than PostgreSQL's 63 bytes (it would cut it \
                 short, and name another)",
                "r".repeat(64)
            )
        );
        assert!(grants(Component::InboxConsumer, &"r".repeat(63), "public").is_ok());
        assert_eq!(
            refused("a\0b").to_string(),
            "the role name \"a\\0b\" holds a NUL character, which PostgreSQL's names cannot"
        );
        assert_eq!(
            grants(Component::InboxConsumer, "inbox", "")
                .unwrap_err()
                .what,
            "schema"
        );
    }

    #[test]
    fn mysql_grants_name_tables_only_with_names_quoted_as_given() {
        let sql = mysql_grants(Component::MessageRelay, "o'brien@10.0.%", "shop`s").unwrap();
        let lines: Vec<&str> = sql.lines().collect();
        assert_eq!(
            lines[0],
            "-- What the outbox's relay needs on MySQL or MariaDB (outbox-runtime 0.1.0)."
        );
        assert_eq!(
            &lines[1..],
            [
                "GRANT SELECT ON `shop``s`.`__diesel_schema_migrations` TO 'o''brien'@'10.0.%';",
                "GRANT SELECT, UPDATE, DELETE ON `shop``s`.`outbox_events` TO 'o''brien'@'10.0.%';",
                "GRANT SELECT, UPDATE ON `shop``s`.`outbox_aggregates` TO 'o''brien'@'10.0.%';",
                "GRANT INSERT, SELECT, DELETE ON `shop``s`.`outbox_published` TO 'o''brien'@'10.0.%';",
            ]
        );
        // Without a host: any host, or a MariaDB role.
        let service = mysql_grants(Component::Service, "svc", "shop").unwrap();
        assert!(
            service
                .contains("GRANT SELECT, INSERT, UPDATE ON `shop`.`outbox_dedup_keys` TO 'svc';"),
            "{service}"
        );
        // The user name may hold an `@`: the host follows the last.
        assert!(
            mysql_grants(Component::Operator, "a@b@c", "shop")
                .unwrap()
                .contains(" TO 'a@b'@'c';")
        );
    }

    #[test]
    fn an_account_or_database_mysql_would_not_take_as_given_is_refused_naming_why() {
        let refused = |account: &str| {
            mysql_grants(Component::InboxConsumer, account, "shop")
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            refused(""),
            "the account name \"\" has an empty user name (MySQL's anonymous user)"
        );
        assert_eq!(
            refused("@%"),
            "the account name \"@%\" has an empty user name (MySQL's anonymous user)"
        );
        assert_eq!(
            refused("inbox@"),
            "the account name \"inbox@\" has an empty host after its `@` (leave the `@` out \
             for any host)"
        );
        assert_eq!(
            refused("in\\box"),
            "the account name \"in\\\\box\" holds a backslash, which MySQL reads as an escape \
             or not by its sql_mode (NO_BACKSLASH_ESCAPES)"
        );
        assert_eq!(
            refused("in\0box"),
            "the account name \"in\\0box\" holds a NUL character, which MySQL's names cannot"
        );
        let database = mysql_grants(Component::InboxConsumer, "inbox", "").unwrap_err();
        assert_eq!((database.what, database.fault), ("database", "is empty"));
    }

    #[test]
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    fn a_role_is_named_as_one_word_of_the_command() {
        assert_eq!(shell_word("outbox_relay"), "outbox_relay");
        assert_eq!(shell_word("Relay-2.eu"), "Relay-2.eu");
        assert_eq!(shell_word("o'brien $x"), "'o'\\''brien $x'");
        assert_eq!(shell_word(""), "''");
    }

    #[test]
    fn components_go_by_their_command_names() {
        for component in Component::ALL {
            assert_eq!(component.name().parse(), Ok(component));
        }
        assert_eq!(
            "relais".parse::<Component>().unwrap_err().to_string(),
            "no component is called \"relais\": the components are service, relay, inbox \
             and operator"
        );
    }
}
