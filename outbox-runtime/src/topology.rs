//! The topology: where a service's events go. One value names the subject prefix its units
//! of work write under and the JetStream stream that captures `{prefix}.>`; the unit of work
//! ([`Outbox::with_topology`](crate::Outbox::with_topology)), the relay
//! ([`RelayConfig::topology`](crate::RelayConfig::topology)) and the inbox
//! ([`InboxConfig::topology`](crate::InboxConfig::topology), the producer's) all take it, so
//! a service configures it once.
//!
//! A prefix that differs between processes (a service writing `acme.>` while the `outbox
//! relay` binary publishes `events.>`) would dead-letter every row. Each unit of work's
//! outbox and each relay therefore record the prefix they use in the table
//! `outbox_topologies`, and each reports, at start-up, the others that differ from its own:
//! the relay when it connects, the outbox at its first unit of work (and every hour after).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

// PostgreSQL's topology registry, `outbox_topologies`.
#[cfg(feature = "postgres")]
use {
    diesel::QueryableByName,
    diesel::result::QueryResult,
    diesel::sql_types::{Text, Timestamptz},
    diesel_async::{AsyncPgConnection, RunQueryDsl},
    std::time::Duration,
};

use crate::publisher::StreamSettings;
use crate::subject::{InvalidSubjectPrefix, validate_prefix};

/// The default subject prefix: events are published to `events.{aggregate_type}.{..}`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "events";

/// A valid subject prefix: one or more NATS tokens joined by `.`, such as `events` or
/// `acme.orders`, checked when it is built. Cheap to clone.
///
/// ```
/// use outbox_runtime::SubjectPrefix;
/// let prefix: SubjectPrefix = "acme.orders".parse()?;
/// assert_eq!(prefix.as_str(), "acme.orders");
/// assert!("acme.*".parse::<SubjectPrefix>().is_err());
/// # Ok::<(), outbox_runtime::subject::InvalidSubjectPrefix>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SubjectPrefix(Arc<str>);

impl SubjectPrefix {
    /// Checks `prefix` and wraps it.
    ///
    /// # Errors
    /// [`InvalidSubjectPrefix`] when a token is empty or holds `.`, `*`, `>`, whitespace or a
    /// control character, when the prefix starts with `$` (reserved by NATS) or `_INBOX`, or
    /// when it is over [`MAX_TOKEN_BYTES`](crate::subject::MAX_TOKEN_BYTES) long.
    pub fn new(prefix: &str) -> Result<Self, InvalidSubjectPrefix> {
        validate_prefix(prefix)?;
        Ok(Self(prefix.into()))
    }

    /// The prefix.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The subject filter of everything under the prefix: `{prefix}.>`.
    pub fn all_subjects(&self) -> String {
        format!("{}.>", self.0)
    }

    /// Whether the subject filter `filter` can match a subject under this prefix: token by
    /// token it equals the prefix or is `*`, until a `>` or the prefix's end, and then it has
    /// a token more. Under `acme.orders`: `acme.orders.>`, `*.orders.Order.*.Placed`, `acme.>`
    /// and `>` can; `acme.orders`, `acme.other.>` and `events.>` cannot.
    pub fn can_match(&self, filter: &str) -> bool {
        let mut tokens = filter.split('.');
        for own in self.0.split('.') {
            match tokens.next() {
                Some(">") => return true,
                Some(token) if token == own || token == "*" => {}
                _ => return false,
            }
        }
        tokens.next().is_some()
    }
}

impl Default for SubjectPrefix {
    /// [`DEFAULT_SUBJECT_PREFIX`].
    fn default() -> Self {
        Self(DEFAULT_SUBJECT_PREFIX.into())
    }
}

impl FromStr for SubjectPrefix {
    type Err = InvalidSubjectPrefix;

    fn from_str(prefix: &str) -> Result<Self, Self::Err> {
        Self::new(prefix)
    }
}

impl TryFrom<&str> for SubjectPrefix {
    type Error = InvalidSubjectPrefix;

    fn try_from(prefix: &str) -> Result<Self, Self::Error> {
        Self::new(prefix)
    }
}

impl TryFrom<String> for SubjectPrefix {
    type Error = InvalidSubjectPrefix;

    fn try_from(prefix: String) -> Result<Self, Self::Error> {
        Self::new(&prefix)
    }
}

impl AsRef<str> for SubjectPrefix {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SubjectPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SubjectPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// Where a service's events go: the subject prefix of every event its units of work write
/// (`{prefix}.{aggregate_type}.{partition_key}.{event_type}`), and the stream that captures
/// `{prefix}.>`. Give the same value to [`Outbox::with_topology`](crate::Outbox::with_topology),
/// [`RelayConfig::topology`](crate::RelayConfig::topology) and, on the consuming side,
/// [`InboxConfig::topology`](crate::InboxConfig::topology).
///
/// ```
/// use outbox_runtime::{StreamSettings, SubjectPrefix, Topology};
/// let topology = Topology::new(
///     "bank".parse::<SubjectPrefix>()?,
///     StreamSettings { name: "BANK".into(), ..StreamSettings::default() },
/// );
/// assert_eq!(topology.subject_prefix.all_subjects(), "bank.>");
/// # Ok::<(), outbox_runtime::subject::InvalidSubjectPrefix>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Topology {
    /// The subject prefix. Default [`DEFAULT_SUBJECT_PREFIX`], `events`.
    pub subject_prefix: SubjectPrefix,
    /// The stream that captures `{prefix}.>`, and what an operator sets on it. Default
    /// [`StreamSettings::default`]: `EVENTS`.
    pub stream: StreamSettings,
}

impl Topology {
    /// The topology of `subject_prefix` and `stream`.
    pub fn new(subject_prefix: SubjectPrefix, stream: StreamSettings) -> Self {
        Self {
            subject_prefix,
            stream,
        }
    }
}

/// Who registers a topology in `outbox_topologies`.
#[cfg(feature = "postgres")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// Units of work write under the prefix.
    Outbox,
    /// A relay publishes the prefix.
    Relay,
}

#[cfg(feature = "postgres")]
impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Self::Outbox => "outbox",
            Self::Relay => "relay",
        }
    }
}

/// A topology another process registered, whose prefix differs from the caller's.
#[cfg(feature = "postgres")]
#[derive(Debug, QueryableByName)]
pub(crate) struct Registered {
    #[diesel(sql_type = Text)]
    role: String,
    #[diesel(sql_type = Text)]
    subject_prefix: String,
    #[diesel(sql_type = Text)]
    stream: String,
    #[diesel(sql_type = Timestamptz)]
    seen_at: time::OffsetDateTime,
}

/// How often a long-running process registers its topology again: the registry forgets a
/// process it has not seen for a day.
#[cfg(feature = "postgres")]
pub(crate) const REGISTER_EVERY: Duration = Duration::from_secs(3600);

/// Records that `role` uses `topology` now, and logs a warning for each process of the other
/// role, seen in the last day, whose prefix differs: the mismatch that would dead-letter
/// every row. Another process registering the same row at once is waited for, up to 5 s
/// whatever the session's `lock_timeout` (the function's own, migration
/// `000017_registration_lock_timeout`).
///
/// # Errors
/// The query's error (the table is missing before the migration `000008_topologies`; a
/// registration held longer than 5 s: "canceling statement due to lock timeout").
#[cfg(feature = "postgres")]
pub(crate) async fn register(
    conn: &mut AsyncPgConnection,
    role: Role,
    topology: &Topology,
) -> QueryResult<()> {
    let others: Vec<Registered> = register_statement(role, topology).load(conn).await?;
    report_mismatches(role, topology, &others);
    Ok(())
}

/// The statement of [`register`], for any connection.
#[cfg(feature = "postgres")]
pub(crate) fn register_statement(role: Role, topology: &Topology) -> RegisterTopology<'_> {
    RegisterTopology {
        role: role.as_str(),
        prefix: topology.subject_prefix.as_str(),
        stream: &topology.stream.name,
    }
}

#[cfg(feature = "postgres")]
crate::outbox::statement::statement! {
    /// Registers a topology and returns the others seen (see [`register`]).
    pub(crate) struct RegisterTopology<'a> {
        role: &'a str => Text,
        prefix: &'a str => Text,
        stream: &'a str => Text,
    }
    sql = "SELECT role, subject_prefix, stream, seen_at FROM outbox_register_topology($1, $2, $3)";
}

/// Warns of each other topology [`register`] found.
#[cfg(feature = "postgres")]
pub(crate) fn report_mismatches(role: Role, topology: &Topology, others: &[Registered]) {
    for other in others {
        tracing::warn!(
            own_prefix = %topology.subject_prefix,
            other_role = %other.role,
            other_prefix = %other.subject_prefix,
            other_stream = %other.stream,
            other_seen_at = %other.seen_at,
            "topology mismatch: this {} uses subject prefix {:?}, but a {} that uses {:?} (stream \
             {:?}) ran on the same outbox in the last day; a relay dead-letters the rows outside \
             its prefix: give the units of work and the relay the same Topology",
            role.as_str(),
            topology.subject_prefix.as_str(),
            other.role,
            other.subject_prefix,
            other.stream,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_checked_when_built() {
        assert_eq!(SubjectPrefix::default().as_str(), "events");
        assert_eq!(
            SubjectPrefix::new("acme.orders").unwrap().to_string(),
            "acme.orders"
        );
        for bad in ["", "a..b", "a.*", "a.>", "$JS", "_INBOX.x", "a b"] {
            let error = SubjectPrefix::new(bad).unwrap_err();
            assert_eq!(error.prefix, bad);
        }
    }

    #[test]
    fn a_filter_can_match_under_a_prefix_or_not() {
        let prefix = SubjectPrefix::new("acme.orders").unwrap();
        for overlapping in [
            "acme.orders.>",
            "acme.orders.Order.*.Placed",
            "*.orders.x",
            "*.*.>",
            "acme.>",
            ">",
        ] {
            assert!(prefix.can_match(overlapping), "{overlapping}");
        }
        for apart in [
            "acme.orders",
            "acme.other.>",
            "acme.*",
            "x.orders.>",
            "events.>",
        ] {
            assert!(!prefix.can_match(apart), "{apart}");
        }
    }
}
