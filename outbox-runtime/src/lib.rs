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
//! #[aggregate(event = OrderEvent)]
//! struct Order {
//!     id: String,
//!     shipped: bool,
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
//! - [`publisher`]: the JetStream side, with the wire contract of every message;
//! - [`inbox`]: idempotent consumers, with exactly-once effects;
//! - [`subject`]: the NATS subject rules every name obeys;
//! - [`database`] and [`nats`]: the toolkit's connections, bounded by timeouts and shown
//!   without their secrets.

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

pub mod aggregate;
pub mod causality;
pub mod database;
pub mod dead_letter;
pub mod event;
pub mod inbox;
pub mod nats;
pub mod outbox;
pub mod publisher;
pub mod relay;
pub mod subject;
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
pub use database::{ConnectError, TimedOut};
pub use event::{DomainEvent, EventType, PayloadError};
pub use inbox::{
    Handler, Inbox, InboxConfig, InboxError, InboxHandle, Metadata, Outcome, UnknownEvents,
    Unreadable,
};
pub use outbox::{
    MIGRATIONS, MigrationError, MissingMigrations, Outbox, OutboxStats, PublishedRows,
    pending_migrations, run_migrations,
};
pub use outbox_derive::{DomainEvent, aggregate};
pub use publisher::{StreamError, StreamSettings};
pub use relay::{BatchReport, DeadLetterPolicy, Relay, RelayConfig, RelayError, RelayHandle};
pub use unit_of_work::{TokenRole, UnitOfWork, UnitOfWorkError};

/// What the macros' generated code names, by absolute path, whatever the user imported.
/// Not a public API: it changes without notice.
#[doc(hidden)]
pub mod __private {
    pub use crate::aggregate::{Aggregate, PendingEvents};
    pub use crate::event::payload::SerdeEvent;
    pub use crate::event::{DomainEvent, EventType, PayloadError};
    pub use serde;

    /// Runs the relay's claim query (in the caller's transaction) and returns how many rows
    /// it claimed. For `examples/relay_bench`, which measures the claim alone.
    pub async fn claim_probe(
        conn: &mut diesel_async::AsyncPgConnection,
        batch_size: i64,
    ) -> diesel::QueryResult<usize> {
        crate::outbox::queries::claim_batch(conn, batch_size, &Default::default())
            .await
            .map(|rows| rows.len())
    }
    pub use std::option::Option;
    pub use std::result::Result;
    pub use std::string::{String, ToString};
}
