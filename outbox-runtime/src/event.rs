//! Domain events: what `#[derive(DomainEvent)]` implements.
//!
//! An event type has a name (the last token of its subject and its `ce-type`), a version,
//! an optional partition key, and a JSON payload. A struct is one event type; an enum is one
//! event type per variant, and the payload of a variant is the variant's own JSON: its fields
//! as an object, not serde's externally tagged `{"Placed": {..}}`, since the type already
//! travels in the `event_type` column and the `ce-type` header; serde's own derives do all the
//! field work, so `rename`, `with`, `default` and the rest keep working.
//!
//! A payload holds only what JSON and PostgreSQL's `jsonb` carry: a NaN or infinite number
//! (which serde_json would silently write as `null`) or a string with a NUL character fails
//! the commit with a [`PayloadError::Json`] that names the value by its path.

pub(crate) mod payload;
mod storable;
pub(crate) mod upcast;

pub use upcast::UpcastError;

/// A domain event: a fact the domain records, written to the outbox and published.
///
/// Implemented by `#[derive(DomainEvent)]`; a hand-written implementation must keep the
/// same contract:
/// - [`event_type`](Self::event_type) returns one of [`EVENT_TYPES`](Self::EVENT_TYPES)'
///   names, a valid NATS subject token (see [`crate::subject::validate_token`]);
/// - [`from_payload`](Self::from_payload) inverts [`to_payload`](Self::to_payload) for
///   every `(event_type, event_version)` pair the value can produce.
pub trait DomainEvent: Sized + Send + 'static {
    /// Every event type and version this Rust type reads, in declaration order: each one it
    /// writes, followed by the older versions its `#[event(upcast(..))]` steps read, oldest
    /// first. An enum may carry the same name at several versions, one variant each.
    const EVENT_TYPES: &'static [EventType];

    /// The event type name of this value: the subject's last token and the `ce-type`.
    fn event_type(&self) -> &'static str;

    /// The version of this value's payload schema, from `#[event(version = N)]` (default 1).
    fn event_version(&self) -> i32;

    /// The value of the `#[event(partition_key)]` field, or `None` to partition by the
    /// aggregate id.
    fn partition_key(&self) -> Option<String>;

    /// The value of the `#[event(dedup_key)]` field: the producer's idempotency key
    /// (`"user-created:42"`), or `None` (the default) for an event that has none. A unit of
    /// work that writes an event whose key an earlier committed event already took writes
    /// nothing for it, or fails, as its [`DuplicateEvents`](crate::DuplicateEvents) says.
    fn dedup_key(&self) -> Option<String> {
        None
    }

    /// The payload: this event's JSON text.
    ///
    /// # Errors
    /// [`PayloadError::Json`] when the value's `Serialize` implementation fails (a map with
    /// non-string keys, say).
    fn to_payload(&self) -> Result<String, PayloadError>;

    /// Decodes a payload written by [`to_payload`](Self::to_payload) for the given event
    /// type and version, or by an older version that this type upcasts (see
    /// [`DomainEvent`](derive@crate::DomainEvent)'s `upcast`).
    ///
    /// # Errors
    /// [`PayloadError::UnknownEventType`] when this type reads no such type and version;
    /// [`PayloadError::Json`] when the payload does not decode (as the version named);
    /// [`PayloadError::Upcast`] when a JSON upcast function refuses it.
    fn from_payload(
        event_type: &str,
        event_version: i32,
        payload: &[u8],
    ) -> Result<Self, PayloadError>;
}

/// The events one consumer takes: a [`DomainEvent`] type (every one is a set of itself), or
/// an enum of several, one per variant, with `#[derive(EventSet)]`.
///
/// [`Handler::Event`](crate::Handler::Event) is an `EventSet`, so one durable consumer
/// handles the events of several aggregates (an account's and a transfer's, say) and a
/// `match` in the handler dispatches them.
///
/// ```
/// use outbox_runtime::{DomainEvent, EventSet};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Debug, Serialize, Deserialize, DomainEvent)]
/// enum AccountEvent { Opened { owner: String }, Credited { cents: i64 } }
///
/// #[derive(Debug, Serialize, Deserialize, DomainEvent)]
/// struct TransferRequested { from: String, to: String, cents: i64 }
///
/// #[derive(Debug, EventSet)]
/// enum BankEvent {
///     Account(AccountEvent),
///     Transfer(TransferRequested),
/// }
///
/// let event = BankEvent::decode("TransferRequested", 1, br#"{"from":"a","to":"b","cents":5}"#)?;
/// assert!(matches!(event, BankEvent::Transfer(TransferRequested { cents: 5, .. })));
/// assert!(BankEvent::decode("Closed", 1, b"{}").is_err());
/// # Ok::<(), outbox_runtime::PayloadError>(())
/// ```
///
/// The derive goes on an enum whose variants each hold one [`DomainEvent`] type. A message is
/// decoded by its `ce-type` and `ce-eventversion` into the variant whose type carries them;
/// two variants that carry the same event type and version could not be told apart, and are
/// a compile error that names both.
pub trait EventSet: Sized + Send + 'static {
    /// The event types of each member, in declaration order: one slice for a
    /// [`DomainEvent`], one per variant for a derived set.
    const MEMBERS: &'static [&'static [EventType]];

    /// Decodes the payload of an event of type `event_type` at `event_version` into the
    /// member that carries it.
    ///
    /// # Errors
    /// [`PayloadError::UnknownEventType`] when no member carries it;
    /// [`PayloadError::Json`] when the payload does not decode.
    fn decode(event_type: &str, event_version: i32, payload: &[u8]) -> Result<Self, PayloadError>;

    /// Every event type of the set, in declaration order.
    fn event_types() -> impl Iterator<Item = EventType> {
        Self::MEMBERS.iter().flat_map(|types| types.iter().copied())
    }
}

impl<T: DomainEvent> EventSet for T {
    const MEMBERS: &'static [&'static [EventType]] = &[T::EVENT_TYPES];

    fn decode(event_type: &str, event_version: i32, payload: &[u8]) -> Result<Self, PayloadError> {
        T::from_payload(event_type, event_version, payload)
    }
}

/// Whether two lists of event types share a name at one version; for the const check of
/// `#[derive(EventSet)]`.
#[doc(hidden)]
pub const fn overlap(first: &[EventType], second: &[EventType]) -> bool {
    let mut i = 0;
    while i < first.len() {
        let mut j = 0;
        while j < second.len() {
            if first[i].version == second[j].version && str_eq(first[i].name, second[j].name) {
                return true;
            }
            j += 1;
        }
        i += 1;
    }
    false
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// One event type a [`DomainEvent`] carries: its name and payload version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventType {
    /// The event type name, a valid NATS subject token.
    pub name: &'static str,
    /// The payload schema version, 1 or more.
    pub version: i32,
}

/// An event payload that cannot be written or read.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    /// The Rust type has no variant for this event type and version.
    #[error(
        "{rust_type} has no event type {event_type:?} at version {event_version} \
         (it carries {})",
        known_types(.known)
    )]
    UnknownEventType {
        /// The Rust type asked to decode.
        rust_type: &'static str,
        /// The event type that was asked for.
        event_type: String,
        /// The version that was asked for.
        event_version: i32,
        /// What the Rust type carries.
        known: Box<[EventType]>,
    },
    /// serde_json could not encode or decode the payload.
    #[error("payload of {rust_type} event {event_type:?} v{event_version}: {source}")]
    Json {
        /// The Rust type being encoded or decoded.
        rust_type: &'static str,
        /// The event type of the payload.
        event_type: String,
        /// The version of the payload.
        event_version: i32,
        /// What serde_json reported, with line and column for a decode.
        #[source]
        source: serde_json::Error,
    },
    /// A JSON upcast function (`#[event(upcast(from = N, json = ..))]`) refused a payload.
    #[error("upcasting {rust_type} event {event_type:?} from v{from_version}: {source}")]
    Upcast {
        /// The Rust type being decoded.
        rust_type: &'static str,
        /// The event type of the payload.
        event_type: String,
        /// The version the refusing upcast reads.
        from_version: i32,
        /// What the function returned.
        #[source]
        source: UpcastError,
    },
}

fn known_types(known: &[EventType]) -> String {
    known
        .iter()
        .map(|t| format!("{} v{}", t.name, t.version))
        .collect::<Vec<_>>()
        .join(", ")
}

impl PayloadError {
    /// The error for a type and version that `T` does not carry.
    pub fn unknown_event_type<T: EventSet>(event_type: &str, event_version: i32) -> Self {
        Self::UnknownEventType {
            rust_type: std::any::type_name::<T>(),
            event_type: event_type.to_owned(),
            event_version,
            known: T::event_types().collect(),
        }
    }

    /// For an [`UnknownEventType`](Self::UnknownEventType) whose type the Rust type does
    /// carry, at a version newer than every one it reads: that newest version. Such a
    /// payload was written by a later release of the producer; a release of the consumer
    /// that reads it can. `None` for any other error, and for an event type the Rust type
    /// does not carry at all, or a version at or below one it reads.
    ///
    /// ```
    /// use outbox_runtime::{DomainEvent, EventSet};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Debug, Serialize, Deserialize, DomainEvent)]
    /// enum OrderEvent { Placed { customer: String }, Shipped }
    ///
    /// let newer = OrderEvent::decode("Placed", 2, b"{}").unwrap_err();
    /// assert_eq!(newer.newest_version_read(), Some(1));
    /// let unknown = OrderEvent::decode("Refunded", 2, b"{}").unwrap_err();
    /// assert_eq!(unknown.newest_version_read(), None);
    /// ```
    pub fn newest_version_read(&self) -> Option<i32> {
        let Self::UnknownEventType {
            event_type,
            event_version,
            known,
            ..
        } = self
        else {
            return None;
        };
        known
            .iter()
            .filter(|known| known.name == event_type)
            .map(|known| known.version)
            .max()
            .filter(|newest| newest < event_version)
    }

    pub(crate) fn json<T>(event_type: &str, event_version: i32, source: serde_json::Error) -> Self {
        Self::Json {
            rust_type: std::any::type_name::<T>(),
            event_type: event_type.to_owned(),
            event_version,
            source,
        }
    }
}
