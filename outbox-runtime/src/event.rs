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

/// A domain event: a fact the domain records, written to the outbox and published.
///
/// Implemented by `#[derive(DomainEvent)]`; a hand-written implementation must keep the
/// same contract:
/// - [`event_type`](Self::event_type) returns one of [`EVENT_TYPES`](Self::EVENT_TYPES)'
///   names, a valid NATS subject token (see [`crate::subject::validate_token`]);
/// - [`from_payload`](Self::from_payload) inverts [`to_payload`](Self::to_payload) for
///   every `(event_type, event_version)` pair the value can produce.
pub trait DomainEvent: Sized + Send + 'static {
    /// Every event type this Rust type carries, in declaration order. An enum may carry the
    /// same name at several versions, one variant each.
    const EVENT_TYPES: &'static [EventType];

    /// The event type name of this value: the subject's last token and the `ce-type`.
    fn event_type(&self) -> &'static str;

    /// The version of this value's payload schema, from `#[event(version = N)]` (default 1).
    fn event_version(&self) -> i32;

    /// The value of the `#[event(partition_key)]` field, or `None` to partition by the
    /// aggregate id.
    fn partition_key(&self) -> Option<String>;

    /// The payload: this event's JSON text.
    ///
    /// # Errors
    /// [`PayloadError::Json`] when the value's `Serialize` implementation fails (a map with
    /// non-string keys, say).
    fn to_payload(&self) -> Result<String, PayloadError>;

    /// Decodes a payload written by [`to_payload`](Self::to_payload) for the given event
    /// type and version.
    ///
    /// # Errors
    /// [`PayloadError::UnknownEventType`] when this type carries no such type and version;
    /// [`PayloadError::Json`] when the payload does not decode.
    fn from_payload(
        event_type: &str,
        event_version: i32,
        payload: &[u8],
    ) -> Result<Self, PayloadError>;
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
        known: &'static [EventType],
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
    pub fn unknown_event_type<T: DomainEvent>(event_type: &str, event_version: i32) -> Self {
        Self::UnknownEventType {
            rust_type: std::any::type_name::<T>(),
            event_type: event_type.to_owned(),
            event_version,
            known: T::EVENT_TYPES,
        }
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
