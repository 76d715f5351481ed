//! Roles and grants on PostgreSQL: the privileges each part of the outbox needs, for
//! deployments where one role runs the migrations and owns the tables, and the service, the
//! relay and the inbox each log in as a role of their own that holds only what it uses.
//!
//! [`grants`] writes the `GRANT` statements for one [`Component`] and role (the `outbox
//! grants` command prints them). The relay and the inbox check at connect that their role
//! holds what they need, and stop with a [`ConnectError`](crate::ConnectError) that names each
//! privilege missing and the command that writes the grants, where they would otherwise
//! start and fail on their first batch or message ("permission denied for table ...") for as
//! long as they ran.
//!
//! Two operations stay with the tables' owner, because PostgreSQL lets no grant give them:
//! the migrations (they create and alter tables), and dropping the archive's days
//! ([`drop_archived`](crate::outbox::drop_archived), from `outbox purge` or the relay's
//! `--purge-older-than` in `--published archive`), since only a table's owner may detach a
//! partition and drop it (PostgreSQL 15 docs, ALTER TABLE and DROP TABLE). Creating the
//! archive's days needs no ownership: `outbox_published_create_partitions` runs as its owner
//! (a `SECURITY DEFINER` function, granted to the relay).

use std::fmt::{self, Write as _};
use std::str::FromStr;

use diesel::QueryableByName;
use diesel::sql_types::{Array, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

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
    /// `inbox-dead-letters`, `purge` (but dropping the archive's days: see the module).
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

/// A role or schema name that PostgreSQL would not take as given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the {what} name {name:?} {fault}")]
pub struct InvalidName {
    /// `role` or `schema`.
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
    let needs = component.needs();
    // One statement per object, its privileges in the order listed.
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
    for (object, privileges) in objects {
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

/// A table or function of the outbox, by its unquoted name (found along the `search_path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Object {
    Table(&'static str),
    Function(&'static str),
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

pub(crate) fn inbox_needs() -> Vec<Need> {
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
    // aggregate; `purge` deletes published rows, archived rows (MySQL, SQLite) and dedup keys.
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
pub(crate) async fn lacking(
    conn: &mut AsyncPgConnection,
    component: Component,
    needs: &[Need],
) -> diesel::QueryResult<Option<String>> {
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

/// `word` as one word of a POSIX shell command: as it is when it needs no quoting, else in
/// single quotes, each single quote written `'\''`.
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
