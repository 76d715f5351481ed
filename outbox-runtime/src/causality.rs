//! Correlation, causation and trace context: what ties an event to the conversation it
//! belongs to and to the message that caused it.
//!
//! Every event carries a *correlation id* (the conversation: all events that follow from one
//! request share it) and a *causation id* (the message that caused it), as the CloudEvents
//! extension attributes `ce-correlationid` and `ce-causationid`. A unit of work started by
//! [`Outbox::transaction`](crate::Outbox::transaction) begins a conversation: a fresh id is
//! both its correlation and its causation id, unless the caller sets them
//! ([`UnitOfWork::set_correlation`](crate::UnitOfWork::set_correlation)). A unit of work run by
//! the inbox for a message inherits that message's correlation id and takes its `ce-id` as
//! causation id, with no code from the handler. A W3C `traceparent`, when known, travels the
//! same way: in the row's headers and the message's `traceparent` header, continued by each
//! handler under a new parent id (W3C Trace Context, section 3.2).

use std::fmt;
use std::str::FromStr;

use uuid::Uuid;

/// The most bytes a correlation or causation id holds (each travels in a header of every
/// message, and a consumer keys messages by ids of this size).
pub const MAX_ID_BYTES: usize = 512;

/// Where an event comes from: its conversation, its cause, and its trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Causality {
    pub correlation_id: String,
    pub causation_id: String,
    pub traceparent: Option<Traceparent>,
    /// The W3C `tracestate` that goes with `traceparent` (vendor data), when known.
    pub tracestate: Option<String>,
}

impl Causality {
    /// The start of a conversation: one fresh id is both correlation and causation.
    pub(crate) fn root() -> Self {
        let id = Uuid::now_v7().hyphenated().to_string();
        #[cfg_attr(not(feature = "opentelemetry"), allow(unused_mut))]
        let mut root = Self {
            correlation_id: id.clone(),
            causation_id: id,
            traceparent: None,
            tracestate: None,
        };
        // The trace of the span the unit of work runs in (an HTTP request's, say).
        #[cfg(feature = "opentelemetry")]
        if let Some((traceparent, tracestate)) = crate::telemetry::current_context() {
            root.traceparent = Some(traceparent);
            root.tracestate = tracestate;
        }
        root
    }

    /// What events emitted while handling a message carry: the message's conversation (its
    /// correlation id, or its id when it has none or one that an outbox row cannot carry:
    /// over [`MAX_ID_BYTES`], or with a NUL), the message as cause, its trace continued.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub(crate) fn caused_by(
        message_id: &str,
        correlation_id: Option<&str>,
        traceparent: Option<&Traceparent>,
    ) -> Self {
        let storable = |id: &&str| id.len() <= MAX_ID_BYTES && !id.contains('\0');
        #[cfg_attr(not(feature = "opentelemetry"), allow(unused_mut))]
        let mut caused = Self {
            correlation_id: correlation_id
                .filter(storable)
                .unwrap_or(message_id)
                .to_owned(),
            causation_id: message_id.to_owned(),
            traceparent: traceparent.map(Traceparent::child),
            tracestate: None,
        };
        // The consumer span the handler runs in, which continues the message's trace.
        #[cfg(feature = "opentelemetry")]
        if let Some((traceparent, tracestate)) = crate::telemetry::current_context() {
            caused.traceparent = Some(traceparent);
            caused.tracestate = tracestate;
        }
        caused
    }

    /// The `headers` column of the events: `{}`, or the `traceparent` header (and its
    /// `tracestate`).
    pub(crate) fn headers_json(&self) -> String {
        match (&self.traceparent, &self.tracestate) {
            (Some(traceparent), None) => format!(r#"{{"traceparent":"{traceparent}"}}"#),
            (Some(traceparent), Some(tracestate)) => serde_json::json!({
                "traceparent": traceparent.to_string(),
                "tracestate": tracestate,
            })
            .to_string(),
            (None, _) => "{}".to_owned(),
        }
    }
}

/// A W3C Trace Context `traceparent` header, version `00` (W3C Trace Context, section 3.2):
/// `00-{trace-id: 32 lowercase hex}-{parent-id: 16 lowercase hex}-{trace-flags: 2 hex}`, where
/// neither id is all zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Traceparent {
    trace_id: u128,
    parent_id: u64,
    flags: u8,
}

/// A `traceparent` value that is not version `00` of the W3C format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "traceparent {0:?} is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>, ids not all zeros)"
)]
pub struct InvalidTraceparent(pub String);

impl Traceparent {
    /// The trace id, as 32 lowercase hex digits.
    pub fn trace_id(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The parent id (the span that sent it), as 16 lowercase hex digits.
    pub fn parent_id(&self) -> String {
        format!("{:016x}", self.parent_id)
    }

    /// The same trace, continued by a new span: same trace id and flags, a new random
    /// parent id (W3C Trace Context, section 3.2.2.3: a new `parent-id` for each outgoing
    /// request).
    pub fn child(&self) -> Self {
        let parent_id = loop {
            let bytes = Uuid::new_v4().into_bytes();
            let id = u64::from_be_bytes(bytes[..8].try_into().expect("8 of 16 bytes"));
            if id != 0 {
                break id;
            }
        };
        Self { parent_id, ..*self }
    }
}

impl Traceparent {
    /// A `traceparent` of these parts, or `None` when an id is zero (invalid, W3C Trace
    /// Context, section 3.2.2).
    #[cfg_attr(not(feature = "opentelemetry"), allow(dead_code))]
    pub(crate) fn from_parts(trace_id: u128, parent_id: u64, flags: u8) -> Option<Self> {
        (trace_id != 0 && parent_id != 0).then_some(Self {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// The trace id, parent id and flags as numbers.
    #[cfg_attr(not(feature = "opentelemetry"), allow(dead_code))]
    pub(crate) fn parts(&self) -> (u128, u64, u8) {
        (self.trace_id, self.parent_id, self.flags)
    }
}

impl FromStr for Traceparent {
    type Err = InvalidTraceparent;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidTraceparent(value.to_owned());
        let lower_hex = |part: &str, len: usize| {
            part.len() == len && part.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        let parts: Vec<&str> = value.split('-').collect();
        let [version, trace, parent, flags] = parts.as_slice() else {
            return Err(invalid());
        };
        if *version != "00"
            || !lower_hex(trace, 32)
            || !lower_hex(parent, 16)
            || !lower_hex(flags, 2)
        {
            return Err(invalid());
        }
        let parsed = Self {
            trace_id: u128::from_str_radix(trace, 16).map_err(|_| invalid())?,
            parent_id: u64::from_str_radix(parent, 16).map_err(|_| invalid())?,
            flags: u8::from_str_radix(flags, 16).map_err(|_| invalid())?,
        };
        if parsed.trace_id == 0 || parsed.parent_id == 0 {
            return Err(invalid());
        }
        Ok(parsed)
    }
}

impl fmt::Display for Traceparent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_w3c_example_round_trips_and_its_child_keeps_the_trace() {
        let parent: Traceparent = EXAMPLE.parse().unwrap();
        assert_eq!(parent.to_string(), EXAMPLE);
        let child = parent.child();
        assert_eq!(child.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(child.parent_id(), parent.parent_id());
        assert!(child.to_string().ends_with("-01"));
    }

    #[test]
    fn malformed_traceparents_are_refused() {
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(
                bad.parse::<Traceparent>(),
                Err(InvalidTraceparent(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    fn handled_messages_pass_on_their_conversation() {
        let traceparent: Traceparent = EXAMPLE.parse().unwrap();
        let caused = Causality::caused_by("m-2", Some("c-1"), Some(&traceparent));
        assert_eq!(
            (caused.correlation_id.as_str(), caused.causation_id.as_str()),
            ("c-1", "m-2")
        );
        assert_eq!(
            caused.traceparent.unwrap().trace_id(),
            traceparent.trace_id()
        );
        let long = "c".repeat(MAX_ID_BYTES + 1);
        for unstorable in [long.as_str(), "a\0b"] {
            let caused = Causality::caused_by("m-3", Some(unstorable), None);
            assert_eq!(caused.correlation_id, "m-3", "a new conversation instead");
        }
        let first = Causality::caused_by("m-1", None, None);
        assert_eq!(first.correlation_id, "m-1");
        assert_eq!(first.headers_json(), "{}");
        let root = Causality::root();
        assert_eq!(root.correlation_id, root.causation_id);
    }
}
