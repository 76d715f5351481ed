//! The transactional outbox for Rust services on diesel-async and NATS JetStream.
//!
//! A service annotates its events and aggregates, commits a unit of work, and its events
//! reach JetStream subjects by themselves, never lost and never published for a transaction
//! that rolled back:
//!
//! ```no_run
//! use outbox_runtime::{DomainEvent, Outbox, PendingEvents, UnitOfWorkError, aggregate};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Serialize, Deserialize, DomainEvent)]
//! enum OrderEvent {
//!     Placed { customer: String },
//!     Shipped { carrier: String },
//! }
//!
//! #[aggregate]
//! struct Order {
//!     id: String,
//!     shipped: bool,
//!     pending_events: PendingEvents<OrderEvent>,
//! }
//!
//! # async fn place(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), UnitOfWorkError> {
//! let mut order = Order { id: "o-1".into(), shipped: false, pending_events: PendingEvents::new() };
//! order.record(OrderEvent::Placed { customer: "ada".into() });
//! Outbox::new()
//!     .transaction(conn, async |uow| {
//!         // Business writes with diesel on `uow.conn()`, then hand over the aggregate:
//!         uow.track(&mut order);
//!         Ok::<_, UnitOfWorkError>(())
//!     })
//!     .await?;
//! // Committed: the relay publishes `events.Order.o-1.Placed`.
//! # Ok(())
//! # }
//! ```
//!
//! The pieces, in the order the data flows:
//! - [`event`]: `#[derive(DomainEvent)]`, event type names, versions, payloads, partition keys;
//! - [`aggregate`](mod@aggregate): `#[aggregate]`, aggregates and their buffer of pending events;
//! - [`unit_of_work`]: one transaction for business rows and outbox rows;
//! - [`causality`]: correlation, causation and trace context of every event;
//! - [`outbox`]: the table (a public contract), its migrations and queries;
//! - [`relay`]: the message relay that publishes committed rows;
//! - [`dead_letter`]: rows the broker kept rejecting, and what an operator does with them;
//! - `replay`: the archive published again to a stream of its own, for a consumer that
//!   joins after the live stream's limits removed the events it needs;
//! - [`publisher`]: the JetStream side, with the wire contract of every message;
//! - [`inbox`]: idempotent consumers, with exactly-once effects, and their dead letters
//!   (listed, replayed once a handler is fixed, or discarded);
//! - [`subject`]: the NATS subject rules every name obeys;
//! - [`database`] and [`nats`]: the toolkit's connections, bounded by timeouts and shown
//!   without their secrets.
//!
//! Cargo features: a service compiles the databases it uses. `postgres` is on by default; a
//! service on MySQL or SQLite alone sets `default-features = false` and names its own, and
//! compiles no PostgreSQL code (nor tokio-postgres). With no database feature at all, the
//! crate serves a crate of event and aggregate definitions (the derives, [`PendingEvents`]).
//! - `postgres` (default): the unit of work on diesel-async's `AsyncPgConnection`, the
//!   [`Relay`](crate::relay) woken by `LISTEN/NOTIFY`, the inbox, the dead-letter and
//!   retention functions and the operator's queries (PostgreSQL 13+,
//!   [`outbox::MINIMUM_POSTGRES`]; pure Rust);
//! - `testing`: `outbox_runtime::testing`, the test kit for services (aggregate tests and an
//!   in-memory outbox on any database; throwaway PostgreSQL databases and streams with
//!   `postgres`);
//! - `opentelemetry`: traces across the broker through `tracing-opentelemetry`: a unit of
//!   work takes the current span's trace context, the relay records a producer span per
//!   publish, the inbox runs each handler in a consumer span (OpenTelemetry messaging
//!   semantic conventions);
//! - `postgres-sync`: `postgres`, and [`Outbox::sync_transaction`](crate::Outbox) and
//!   `sync::SyncUnitOfWork`, the unit of work on a synchronous `diesel::PgConnection` (libpq);
//! - `mysql`: `outbox_runtime::mysql`, the unit of work on diesel-async's
//!   `AsyncMysqlConnection` and the `MysqlRelay` (MySQL 8, MariaDB 10.6+; pure Rust);
//! - `mysql-sync`: `mysql`, and the unit of work on a synchronous `diesel::MysqlConnection`
//!   (libmysqlclient);
//! - `sqlite`: `outbox_runtime::sqlite`, the unit of work on diesel's `SqliteConnection`
//!   (sync, and async through diesel-async's `SyncConnectionWrapper`) and the `SqliteRelay`
//!   (SQLite 3.37+; libsqlite3);
//! - `failpoints`: the crash points of this project's own tests.
//!
//! The others are off by default.

// Every public item says what it is: shapes, units, errors (the crate's own rule).
#![warn(missing_docs)]
// Without a database feature the crate serves a crate of event and aggregate definitions
// only: the unit of work's and the relay's shared parts are compiled, and used by nothing.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code, unused_imports)
)]
// The docs link across backends (the MySQL relay's page to `Relay`, the unit of work's to
// `AsyncPgConnection`, ...); a build without some backend lacks the targets, and its docs
// show those names unlinked. The links are checked in the build with every backend, as
// docs.rs builds it (CI runs `cargo doc -D warnings` on it).
#![cfg_attr(
    not(all(
        feature = "postgres-sync",
        feature = "mysql-sync",
        feature = "sqlite",
        feature = "testing"
    )),
    allow(rustdoc::broken_intra_doc_links)
)]

/// A crash point: with the `failpoints` feature, a test can make the code return `$e` here,
/// as if the process died at this point (the `fail` crate's `return` action); without the
/// feature it compiles to nothing.
#[cfg(feature = "failpoints")]
macro_rules! crash_point {
    ($name:literal, $e:expr) => {
        fail::fail_point!($name, $e)
    };
}
#[cfg(not(feature = "failpoints"))]
macro_rules! crash_point {
    ($name:literal, $e:expr) => {};
}

/// With the `failpoints` feature (for tests only): configures the crash points that the
/// environment variable `FAILPOINTS` names, in the `fail` crate's syntax (`name=action`,
/// several separated by `;`, as `fail::FailScenario::setup` reads it), once per process, when
/// the first relay connects. How a test sets a crash point in a process it starts (the
/// `outbox` command); in a test's own process, `fail::cfg` does it. Without the variable it
/// changes nothing. Not `FailScenario::setup` itself: its guard holds the crate's scenario
/// lock until dropped, and the crash-point tests of one binary take turns on that lock.
///
/// # Panics
/// On an entry without `=`, or one whose action the `fail` crate cannot parse.
#[cfg(feature = "failpoints")]
pub(crate) fn crash_points_from_env() {
    static READ: std::sync::Once = std::sync::Once::new();
    READ.call_once(|| {
        let Ok(points) = std::env::var("FAILPOINTS") else {
            return;
        };
        for point in points.split(';').filter(|point| !point.trim().is_empty()) {
            let (name, actions) = point
                .split_once('=')
                .unwrap_or_else(|| panic!("FAILPOINTS: {point:?} is not name=action"));
            fail::cfg(name.trim(), actions.trim())
                .unwrap_or_else(|error| panic!("FAILPOINTS: {point:?}: {error}"));
        }
    });
}

pub mod aggregate;
pub mod causality;
#[cfg(any(feature = "mysql", feature = "sqlite"))]
mod commits;
pub mod database;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod dead_letter;
pub mod event;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod inbox;
#[cfg(feature = "mysql")]
pub mod mysql;
pub mod nats;
pub mod outbox;
pub mod privileges;
pub mod publisher;
pub mod relay;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod replay;
mod spawned;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod subject;
#[cfg(any(feature = "postgres-sync", feature = "mysql-sync", feature = "sqlite"))]
pub mod sync;
#[cfg(feature = "opentelemetry")]
mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod topology;
pub mod unit_of_work;

// The crates whose types appear in this crate's API, at the versions and with the features
// it was built with: a service needs only `outbox-runtime`, `serde` and `tokio` in its
// Cargo.toml. For diesel's derives (`Queryable`, `Insertable`, ...), whose code names the
// path `diesel`, bring it into scope with `use outbox_runtime::diesel;`.
#[doc(no_inline)]
pub use async_nats;
#[doc(no_inline)]
pub use diesel;
#[doc(no_inline)]
pub use diesel_async;
#[doc(no_inline)]
pub use serde_json;
#[doc(no_inline)]
pub use time;
#[doc(no_inline)]
pub use uuid;

pub use aggregate::{Aggregate, PendingEvents};
pub use causality::{InvalidTraceparent, Traceparent};
#[cfg(feature = "postgres")]
pub use database::Connector;
pub use database::{ConnectError, Pooled, TimedOut};
pub use event::{DomainEvent, EventSet, EventType, PayloadError, UpcastError};
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub use inbox::{
    Handler, Inbox, InboxConfig, InboxConnection, InboxError, InboxHandle, Metadata, NewerVersions,
    Outcome, UnknownEvents, Unreadable,
};
pub use outbox::{
    DEFAULT_MAX_PAYLOAD_BYTES, MigrationError, MissingMigrations, Outbox, OutboxStats,
    PublishedRows, TablesElsewhere,
};
#[cfg(feature = "postgres")]
pub use outbox::{
    MIGRATIONS, missing_migrations, pending_migrations, run_migrations, run_migrations_on,
};
/// `#[derive(DomainEvent)]`: a struct is one event type, an enum one event type per variant.
///
/// The type must also derive serde's `Serialize` and `Deserialize` (a unit struct needs
/// neither: its payload is `{}`). The payload is the JSON of the struct, or of the variant's
/// own fields (not serde's `{"Variant": {..}}`): a variant has named fields, one unnamed
/// field (the payload type), or none. serde's field attributes (`rename`, `with`,
/// `default`, ...) all apply to the payload.
///
/// # Attributes
///
/// | attribute | on | default | |
/// |---|---|---|---|
/// | `#[event(name = "..")]` | the struct, or a variant | serde's name, else the Rust name | the event type: last subject token, `ce-type`, `event_type` column |
/// | `#[event(version = N)]` | the struct, or a variant | 1 | `ce-dataversion`, `event_version`; 1 to 2,147,483,647 |
/// | `#[event(partition_key)]` | one field | the aggregate id | the event's partition key |
/// | `#[event(dedup_key)]` | one field | none | the producer's idempotency key: a later unit of work with the same key writes nothing for it ([`DuplicateEvents`]) |
/// | `#[event(upcast(from = N, json = f))]` | the struct, or a variant | none | reads version N's JSON through `f` as version N + 1 |
/// | `#[event(upcast(from = N, type = T))]` | the struct, or a variant | none | reads version N as a `T`, which version N + 1's type converts `From` |
///
/// - **name**: a valid NATS subject token (not empty, at most 256 bytes, no `.`, `*`, `>`,
///   whitespace or control character), checked at compile time on the literal. Without it,
///   serde's name is used when serde renames the type: the struct's or the variant's
///   `#[serde(rename = "..")]`, or the enum's `#[serde(rename_all = "..")]` rule applied to
///   the variant (so the wire names stay the ones you chose); else the Rust name (a raw
///   identifier without its `r#`). serde's `rename(serialize = .., deserialize = ..)` form is
///   refused: an event type has one name. One name may be carried at several versions, one
///   variant each; the same name and version twice is a compile error.
/// - **version**: a whole number literal from 1.
/// - **partition_key**: the field's value through `Display` (`ToString`): `String`, `&str`,
///   integers, `Uuid`, any type of yours that implements `Display`; it must be a valid
///   subject token, which the unit of work checks at commit. An `Option` has no `Display`:
///   store the key itself. Without one, events are partitioned by their aggregate's id.
///
/// - **upcast**: how a consumer built today reads what was published years ago. Each
///   older version the type still reads has one upcast to the version after it, so a
///   payload of any version from the oldest declared one is taken one version at a time to
///   the current type; [`Metadata::event_version`](crate::Metadata) still tells a handler
///   which version arrived. `type = T` names the old payload's Rust type (any `Deserialize`
///   type, kept beside the event), and version N + 1's type (the next upcast's `T`, or this
///   event at its current version: the struct, or the enum for a variant) implements
///   `From<T>`. `json = f` is for a version whose type is gone: `f` is a
///   `fn(serde_json::Value) -> Result<serde_json::Value, E>` (`E` any error, a `String` or
///   a `&str`) from version N's JSON to version N + 1's; an `Err` fails the decode with
///   [`PayloadError::Upcast`]. A version without its upcast, two upcasts for one version, a
///   `from` at or above the current version, an older version that another variant also
///   carries, and a typed upcast into a version that has no type (its own upcast is `json`)
///   are compile errors on the token that is wrong.
///
/// Every misuse (a name with a dot, a version of 0, two partition keys, an `#[event]` key in
/// the wrong place, a serde attribute that would change the payload's shape, a broken upcast
/// chain) is a compile error on the token that is wrong.
///
/// An event may be generic over its fields' types (`enum Renamed<Name> { Renamed { from:
/// Name, to: Name } }`): it is an event for each type argument that makes it serde-able,
/// `Send` and `'static`, and its type name is the item's, the same for every argument. It
/// may not borrow: a lifetime parameter is a compile error.
///
/// # Example
///
/// ```
/// use outbox_runtime::DomainEvent;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, DomainEvent)]
/// enum OrderEvent {
///     Placed { customer: String },                 // "Placed", version 1
///     #[event(name = "Shipped", version = 2)]
///     ShippedV2 { carrier: String },               // "Shipped", version 2
///     #[serde(rename = "order-cancelled")]
///     Cancelled,                                   // "order-cancelled"
/// }
///
/// #[derive(Serialize, Deserialize, DomainEvent)]
/// #[event(name = "PaymentCaptured", version = 3)]
/// struct Captured {
///     #[event(partition_key)]                      // partitioned by merchant, not by order
///     merchant: u64,
///     amount_cents: i64,
/// }
///
/// let event = OrderEvent::ShippedV2 { carrier: "dhl".into() };
/// assert_eq!((event.event_type(), event.event_version()), ("Shipped", 2));
/// assert_eq!(event.to_payload().unwrap(), r#"{"carrier":"dhl"}"#);
/// assert_eq!(OrderEvent::Cancelled.event_type(), "order-cancelled");
/// let captured = Captured { merchant: 42, amount_cents: 990 };
/// assert_eq!(captured.partition_key().as_deref(), Some("42"));
/// ```
///
/// An event at version 3 that still reads versions 1 and 2:
///
/// ```
/// use outbox_runtime::{DomainEvent, UpcastError};
/// use serde::{Deserialize, Serialize};
/// use serde_json::{Value, json};
///
/// /// Version 3: the name split in two.
/// #[derive(Debug, Serialize, Deserialize, DomainEvent)]
/// #[event(version = 3)]
/// #[event(upcast(from = 1, json = v1_to_v2), upcast(from = 2, type = CustomerRegisteredV2))]
/// struct CustomerRegistered { given_name: String, family_name: String, email: String }
///
/// /// Version 2, kept as a type: `{"name": .., "email": ..}`.
/// #[derive(Deserialize)]
/// struct CustomerRegisteredV2 { name: String, email: String }
///
/// impl From<CustomerRegisteredV2> for CustomerRegistered {
///     fn from(v2: CustomerRegisteredV2) -> Self {
///         let (given, family) = v2.name.split_once(' ').unwrap_or((&v2.name, ""));
///         Self { given_name: given.into(), family_name: family.into(), email: v2.email }
///     }
/// }
///
/// /// Version 1 (its type is gone) had no email: `{"name": ..}`.
/// fn v1_to_v2(mut v1: Value) -> Result<Value, UpcastError> {
///     let name = v1.get_mut("name").ok_or("a v1 payload has a name")?.take();
///     Ok(json!({ "name": name, "email": "" }))
/// }
///
/// let read = |version, payload: &str| {
///     CustomerRegistered::from_payload("CustomerRegistered", version, payload.as_bytes())
/// };
/// let v1 = read(1, r#"{"name":"Ada Lovelace"}"#)?;
/// assert_eq!((v1.given_name.as_str(), v1.email.as_str()), ("Ada", ""));
/// let v2 = read(2, r#"{"name":"Alan Turing","email":"alan@example.com"}"#)?;
/// assert_eq!(v2.family_name, "Turing");
/// assert!(read(1, "{}").is_err());                // the upcast's Err, as PayloadError::Upcast
/// assert!(read(4, "{}").is_err());                // no such version
/// # Ok::<(), outbox_runtime::PayloadError>(())
/// ```
pub use outbox_derive::DomainEvent;
/// `#[derive(EventSet)]`: the events one consumer takes, one variant per event type (see
/// the trait [`EventSet`](trait@EventSet)).
pub use outbox_derive::EventSet;

/// `#[aggregate]`: makes a struct with named fields, one of them a
/// `PendingEvents<EventType>`, an [`Aggregate`] that records events of `EventType` (a
/// [`DomainEvent`]).
///
/// # Arguments and markers
///
/// | | where | default | |
/// |---|---|---|---|
/// | `PendingEvents<EventType>` | one field | required | holds the events recorded and not yet committed; its type argument is the event type the aggregate records |
/// | `name = ".."` | the attribute | the struct's name | the aggregate type: second subject token, `ce-aggregatetype`, `aggregate_type` column; a valid subject token, checked at compile time |
/// | `#[aggregate_id]` | one field | the field named `id` | the aggregate id: `ce-subject`, `aggregate_id`, the default partition key |
///
/// The id field's value is taken through `Display` (`ToString`): `String`, `Uuid`,
/// integers, or any type of yours that implements `Display`; the unit of work checks at
/// commit that it is a valid subject token.
///
/// The events field is declared, not hidden: a struct literal sets it with
/// `PendingEvents::new()` (or `Default::default()`), and a literal that forgets it gets
/// rustc's "missing field" error on a field the reader can see. Any name does; the examples
/// use `pending_events`.
///
/// # What it adds
///
/// - On the events field: `#[serde(skip)]` when the struct derives serde's `Serialize` or
///   `Deserialize`, `#[diesel(skip_insertion)]` with diesel's `Insertable`,
///   `#[diesel(skip_update)]` with `AsChangeset` (unless the field says itself how serde or
///   diesel treat it). `Queryable`, `Selectable` and `QueryableByName` are refused (they map
///   every field to a column: derive them on a row struct and build the aggregate from it).
/// - `impl Aggregate`, and the inherent methods `record(event)`, `pending_events()` and
///   `discard_pending_events()`, so callers need not import the trait.
///
/// Misuses (an enum or a tuple struct, no id field, two `#[aggregate_id]`, no events field
/// or two, an unknown argument, an invalid name) are compile errors on the token that is
/// wrong.
///
/// # Example
///
/// ```
/// use outbox_runtime::{DomainEvent, PendingEvents, aggregate};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, DomainEvent)]
/// enum AccountEvent {
///     Opened { owner: String },
/// }
///
/// #[aggregate(name = "Account")]
/// struct BankAccount {
///     #[aggregate_id]
///     number: u64,                                 // the id, through Display
///     owner: String,
///     pending_events: PendingEvents<AccountEvent>,
/// }
///
/// let mut account = BankAccount {
///     number: 7,
///     owner: "ada".into(),
///     pending_events: PendingEvents::new(),
/// };
/// account.record(AccountEvent::Opened { owner: account.owner.clone() });
/// use outbox_runtime::Aggregate;
/// assert_eq!((BankAccount::AGGREGATE_TYPE, account.aggregate_id()), ("Account", "7".to_owned()));
/// assert_eq!(account.pending_events().len(), 1);
/// account.discard_pending_events();                // or commit them in a unit of work
/// ```
pub use outbox_derive::aggregate;
pub use publisher::{StreamError, StreamSettings};
#[cfg(feature = "postgres")]
pub use relay::Relay;
pub use relay::{BatchReport, DeadLetterPolicy, RelayConfig, RelayError, RelayHandle};
pub use topology::{DEFAULT_SUBJECT_PREFIX, SubjectPrefix, Topology};
#[cfg(feature = "postgres")]
pub use unit_of_work::transaction_status;
pub use unit_of_work::{
    BackendConnection, CollectEvents, DuplicateEvents, OutboxConnection, TokenRole, TransactionId,
    TransactionStatus, UnitOfWork, UnitOfWorkError,
};

/// What the macros' generated code names, by absolute path, whatever the user imported.
/// Not a public API: it changes without notice.
#[doc(hidden)]
pub mod __private {
    pub use crate::aggregate::{Aggregate, PendingEvents};
    pub use crate::event::payload::SerdeEvent;
    pub use crate::event::upcast::{
        UpcastFrom, from_json_value, json_bytes, read_json, read_old, upcast_into, upcast_json,
    };
    pub use crate::event::{DomainEvent, EventSet, EventType, PayloadError, overlap};
    pub use serde;

    /// Runs the relay's claim query and returns how many rows it claimed, in the caller's
    /// transaction, which the caller marks as a relay batch's (`SET LOCAL
    /// outbox.relay_batch = 'on'`; elsewhere the claim fails). For `examples/relay_bench`,
    /// which measures the claim alone, and the tests of that check.
    #[cfg(feature = "postgres")]
    pub async fn claim_probe(
        conn: &mut diesel_async::AsyncPgConnection,
        batch_size: i64,
    ) -> diesel::QueryResult<usize> {
        crate::outbox::queries::claim_batch(conn, batch_size, &Default::default())
            .await
            .map(|rows| rows.len())
    }
    pub use std::marker::Send;
    pub use std::option::Option;
    pub use std::result::Result;
    pub use std::string::{String, ToString};
    pub use std::vec::Vec;

    /// What an `#[event(partition_key)]` field's type must be: written with `Display`. The
    /// trait exists for its compile error, which says so on the field.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be a partition key: a partition key is written with `Display`",
        label = "this field is the event's partition key",
        note = "a partition key is a type that implements `Display`: String, &str, integers, \
                Uuid, or a type of yours; for an `Option`, store the key itself, or drop \
                #[event(partition_key)] to partition by the aggregate id"
    )]
    pub trait PartitionKeyValue {
        fn to_partition_key(&self) -> String;
    }

    impl<T: std::fmt::Display + ?Sized> PartitionKeyValue for T {
        fn to_partition_key(&self) -> String {
            self.to_string()
        }
    }

    /// What an `#[event(dedup_key)]` field's type must be: a string or a UUID, or an
    /// `Option` of one for an event that carries a key only sometimes. The trait exists for
    /// its compile error, which says so on the field.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be a dedup key: a dedup key is a String, a &str or a Uuid, \
                   or an Option of one",
        label = "this field is the event's dedup key",
        note = "format the key you mean into a String field (\"user-created:42\")"
    )]
    pub trait DedupKeyValue {
        fn to_dedup_key(&self) -> Option<String>;
    }

    impl DedupKeyValue for str {
        fn to_dedup_key(&self) -> Option<String> {
            Some(self.to_owned())
        }
    }

    impl DedupKeyValue for String {
        fn to_dedup_key(&self) -> Option<String> {
            Some(self.clone())
        }
    }

    impl DedupKeyValue for uuid::Uuid {
        fn to_dedup_key(&self) -> Option<String> {
            Some(self.to_string())
        }
    }

    impl<T: DedupKeyValue + ?Sized> DedupKeyValue for &T {
        fn to_dedup_key(&self) -> Option<String> {
            (**self).to_dedup_key()
        }
    }

    impl<T: DedupKeyValue> DedupKeyValue for Option<T> {
        fn to_dedup_key(&self) -> Option<String> {
            self.as_ref().and_then(T::to_dedup_key)
        }
    }

    /// What an aggregate's id field's type must be: written with `Display`. The trait exists
    /// for its compile error, which says so on the field.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be an aggregate id: an aggregate id is written with `Display`",
        label = "this field is the aggregate's id",
        note = "an aggregate id is a type that implements `Display`: String, Uuid, integers, \
                or a type of yours; mark another field #[aggregate_id] if this one is not the id"
    )]
    pub trait AggregateIdValue {
        fn to_aggregate_id(&self) -> String;
    }

    impl<T: std::fmt::Display + ?Sized> AggregateIdValue for T {
        fn to_aggregate_id(&self) -> String {
            self.to_string()
        }
    }
}

/// The variables `pairs` names, as the process's environment gives them: for the unit tests
/// of what reads libpq's and libmysqlclient's variables.
#[cfg(all(test, any(feature = "postgres", feature = "mysql")))]
pub(crate) fn environment_of<'a>(
    pairs: &'a [(&'a str, &'a str)],
) -> impl Fn(&str) -> Option<String> + 'a {
    |name| {
        pairs
            .iter()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| (*value).to_owned())
    }
}
