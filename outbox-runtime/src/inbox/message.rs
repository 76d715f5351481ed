//! What a consumer reads from a message: its id, event type and version, aggregate,
//! sequence, partition key, conversation and trace, decoded from the headers the relay
//! writes (see [`crate::publisher`]), percent-decoding the `ce-` values as the CloudEvents
//! NATS binding requires (section 3.1.3.2).

use std::str::FromStr;

use async_nats::header::{HeaderName, HeaderValue};
use async_nats::{HeaderMap, jetstream};
use percent_encoding::percent_decode_str;

use crate::causality::{MAX_ID_BYTES, Traceparent};

/// A message as the handler sees it, beside its decoded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Metadata {
    /// The message id: `ce-id`, else `Nats-Msg-Id`. The inbox records it with `source`.
    pub id: String,
    /// `ce-source`, when present: CloudEvents makes `source` and `id` together unique.
    pub source: Option<String>,
    /// `ce-type`.
    pub event_type: String,
    /// `ce-eventversion`, 1 or more; 1 when absent (a value below 1 makes the message
    /// unreadable).
    pub event_version: i32,
    /// `ce-aggregatetype`: the aggregate type. Every message of the relay has one; a foreign
    /// message without the header gets the empty string.
    pub aggregate_type: String,
    /// `ce-subject`: the aggregate id. Every message of the relay has one; a foreign message
    /// without the header gets the empty string (and is then ordered by its partition key,
    /// not by aggregate).
    pub aggregate_id: String,
    /// `ce-sequence`: the event's sequence in its aggregate, from 1. Every message of the
    /// relay has one; a foreign message without the header gets 0.
    pub sequence: i64,
    /// `ce-partitionkey`, else the subject: messages with equal keys are handled one at a
    /// time, in stream order.
    pub partition_key: String,
    /// The NATS subject.
    pub subject: String,
    /// `ce-correlationid`, when present.
    pub correlation_id: Option<String>,
    /// `ce-causationid`, when present.
    pub causation_id: Option<String>,
    /// `traceparent`, when present and valid.
    pub traceparent: Option<Traceparent>,
    /// The message's sequence in the stream.
    pub stream_sequence: u64,
    /// How many times JetStream has delivered it, this time included.
    pub deliveries: u64,
}

/// A message the consumer cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnreadableMessage {
    /// A header the consumer needs is missing.
    #[error("message on {subject} has no {header} header")]
    MissingHeader {
        /// The subject it came on.
        subject: String,
        /// The missing header (`ce-id` or `Nats-Msg-Id`; `ce-type`).
        header: &'static str,
    },
    /// A header's value is not what the contract says.
    #[error("message on {subject}: header {header} is invalid: {value:?}")]
    InvalidHeader {
        /// The subject it came on.
        subject: String,
        /// The header.
        header: &'static str,
        /// Its value, as received.
        value: String,
    },
    /// A header that identifies the message or its aggregate is longer than
    /// [`MAX_ID_BYTES`]: the inbox keys its tables by these, and a database index holds
    /// about 2,700 bytes a row (PostgreSQL docs, section 67.4, B-tree "index row size").
    #[error(
        "message on {subject}: header {header} is {len} bytes long, over the limit of \
         {MAX_ID_BYTES} bytes"
    )]
    TooLong {
        /// The subject it came on.
        subject: String,
        /// The header.
        header: &'static str,
        /// Its length in bytes, decoded.
        len: usize,
    },
    /// It did not come from a JetStream consumer (no delivery information).
    #[error("message on {subject} carries no JetStream delivery information: {reason}")]
    NotJetStream {
        /// The subject it came on.
        subject: String,
        /// What async-nats reported.
        reason: String,
    },
}

impl Metadata {
    /// Reads a delivered message's metadata.
    ///
    /// # Errors
    /// [`UnreadableMessage`] naming the header that is missing or invalid.
    pub fn read(message: &jetstream::Message) -> Result<Self, UnreadableMessage> {
        let subject = message.subject.to_string();
        let info = message
            .info()
            .map_err(|e| UnreadableMessage::NotJetStream {
                subject: subject.clone(),
                reason: e.to_string(),
            })?;
        let empty = HeaderMap::new();
        let headers = message.headers.as_ref().unwrap_or(&empty);
        let deliveries = u64::try_from(info.delivered).unwrap_or(1);
        Self::from_headers(subject, headers, info.stream_sequence, deliveries)
    }

    /// Reads the metadata of a message on `subject` with `headers`, delivered `deliveries`
    /// times from `stream_sequence`: [`read`](Self::read)'s decoding, for a message kept in
    /// a dead letter.
    pub(super) fn from_headers(
        subject: String,
        headers: &HeaderMap,
        stream_sequence: u64,
        deliveries: u64,
    ) -> Result<Self, UnreadableMessage> {
        let text = |name: &'static str| decoded(headers, &subject, name);

        let (id, id_header) = match text("ce-id")? {
            Some(id) => (id, "ce-id"),
            None => (
                decoded(headers, &subject, "Nats-Msg-Id")?.ok_or_else(|| {
                    UnreadableMessage::MissingHeader {
                        subject: subject.clone(),
                        header: "ce-id",
                    }
                })?,
                "Nats-Msg-Id",
            ),
        };
        let source = text("ce-source")?;
        let aggregate_type = text("ce-aggregatetype")?;
        let aggregate_id = text("ce-subject")?;
        // CloudEvents 1.0, section 3.1.1: id and source are non-empty strings.
        for (header, value) in [(id_header, Some(&id)), ("ce-source", source.as_ref())] {
            if value.is_some_and(String::is_empty) {
                return Err(UnreadableMessage::InvalidHeader {
                    subject: subject.clone(),
                    header,
                    value: String::new(),
                });
            }
        }
        let identities = [
            (id_header, Some(&id)),
            ("ce-source", source.as_ref()),
            ("ce-aggregatetype", aggregate_type.as_ref()),
            ("ce-subject", aggregate_id.as_ref()),
        ];
        for (header, value) in identities {
            let Some(value) = value else { continue };
            if value.len() > MAX_ID_BYTES {
                return Err(UnreadableMessage::TooLong {
                    subject: subject.clone(),
                    header,
                    len: value.len(),
                });
            }
            // The inbox stores these as text, which cannot hold NUL (a decoded `%00`).
            if value.contains('\0') {
                return Err(UnreadableMessage::InvalidHeader {
                    subject: subject.clone(),
                    header,
                    value: storable_text(value),
                });
            }
        }
        let event_type = text("ce-type")?.ok_or_else(|| UnreadableMessage::MissingHeader {
            subject: subject.clone(),
            header: "ce-type",
        })?;
        let number = |name: &'static str, value: Option<String>| -> Result<Option<i64>, _> {
            value
                .map(|v| {
                    v.parse::<i64>()
                        .map_err(|_| UnreadableMessage::InvalidHeader {
                            subject: subject.clone(),
                            header: name,
                            value: v.clone(),
                        })
                })
                .transpose()
        };
        let event_version = number("ce-eventversion", text("ce-eventversion")?)?.unwrap_or(1);
        // A version is 1 or more (`EventType::version`; the outbox's column is checked so).
        let event_version = i32::try_from(event_version)
            .ok()
            .filter(|version| *version >= 1)
            .ok_or_else(|| UnreadableMessage::InvalidHeader {
                subject: subject.clone(),
                header: "ce-eventversion",
                value: event_version.to_string(),
            })?;
        let sequence = number("ce-sequence", text("ce-sequence")?)?;
        // An invalid trace context does not make the event unreadable: it is dropped.
        let traceparent = headers.get("traceparent").and_then(|value| {
            match value.as_str().parse::<Traceparent>() {
                Ok(traceparent) => Some(traceparent),
                Err(error) => {
                    tracing::warn!(%subject, %error, "ignoring an invalid traceparent");
                    None
                }
            }
        });
        Ok(Self {
            id,
            source,
            event_type,
            event_version,
            aggregate_type: aggregate_type.unwrap_or_default(),
            aggregate_id: aggregate_id.unwrap_or_default(),
            sequence: sequence.unwrap_or_default(),
            partition_key: text("ce-partitionkey")?.unwrap_or_else(|| subject.clone()),
            correlation_id: text("ce-correlationid")?,
            causation_id: text("ce-causationid")?,
            traceparent,
            stream_sequence,
            deliveries,
            subject,
        })
    }
}

impl Metadata {
    /// The event's place in its aggregate: aggregate type, id and `ce-sequence`, when the
    /// message carries all three (every message of the relay does), the sequence from 1.
    pub(super) fn place(&self) -> Option<(&str, &str, i64)> {
        let placed =
            !self.aggregate_type.is_empty() && !self.aggregate_id.is_empty() && self.sequence >= 1;
        placed.then_some((&self.aggregate_type, &self.aggregate_id, self.sequence))
    }
}

/// What a message is ordered by, read before it is read in full: its aggregate (source, type
/// and id) when it names one, else its partition key, else its subject. The consumer
/// handles the messages of one ordering key one at a time, in stream order.
pub(super) fn ordering_key(message: &jetstream::Message) -> String {
    let subject = message.subject.as_str();
    let Some(headers) = message.headers.as_ref() else {
        return subject.to_owned();
    };
    let raw = |name: &str| headers.get(name).map(|value| value.as_str());
    match (raw("ce-aggregatetype"), raw("ce-subject")) {
        // The raw (encoded) values: equal values encode equally.
        (Some(aggregate_type), Some(aggregate_id)) => format!(
            "{}\u{0}{aggregate_type}\u{0}{aggregate_id}",
            raw("ce-source").unwrap_or_default()
        ),
        _ => raw("ce-partitionkey").unwrap_or(subject).to_owned(),
    }
}

/// A header's value, percent-decoded; `None` when absent.
fn decoded(
    headers: &HeaderMap,
    subject: &str,
    name: &'static str,
) -> Result<Option<String>, UnreadableMessage> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    percent_decode_str(value.as_str())
        .decode_utf8()
        .map(|text| Some(text.into_owned()))
        .map_err(|_| UnreadableMessage::InvalidHeader {
            subject: subject.to_owned(),
            header: name,
            value: value.as_str().to_owned(),
        })
}

/// The headers of a message as JSON (name to the array of its values), for the dead-letter
/// table. A NUL character, which `jsonb` cannot store, is written as U+FFFD; the message
/// itself stays in the stream at its stream sequence.
pub(super) fn headers_json(message: &jetstream::Message) -> serde_json::Value {
    let mut object = serde_json::Map::new();
    if let Some(headers) = &message.headers {
        for (name, values) in headers.iter() {
            let values = values
                .iter()
                .map(|value| serde_json::Value::String(storable_text(value.as_str())))
                .collect();
            object.insert(
                storable_text(name.as_ref()),
                serde_json::Value::Array(values),
            );
        }
    }
    serde_json::Value::Object(object)
}

/// The headers [`headers_json`] wrote, as a message's again; a value that is not a string,
/// or a name or value NATS refuses, is left out (the dead letter's `headers` column keeps it).
pub(super) fn headers_from_json(json: &serde_json::Value) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let Some(object) = json.as_object() else {
        return headers;
    };
    for (name, values) in object {
        let Some(values) = values.as_array() else {
            continue;
        };
        // Parsed, not converted: async-nats's conversions from `&str` panic on what they
        // refuse.
        let Ok(name) = HeaderName::from_str(name) else {
            continue;
        };
        for value in values.iter().filter_map(serde_json::Value::as_str) {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.append(name.clone(), value);
            }
        }
    }
    headers
}

/// `text` without NUL characters (PostgreSQL's `text` and `jsonb` refuse them): each becomes
/// U+FFFD.
pub(super) fn storable_text(text: &str) -> String {
    text.replace('\0', "\u{fffd}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead letter's headers become a message's again, each value in its order; what NATS
    /// could not carry (a name with a space, a value with a line break, a value that is not
    /// a string) is left out rather than sent.
    #[test]
    fn a_dead_letters_headers_are_a_messages_again() {
        let json = serde_json::json!({
            "ce-id": ["m-1"],
            "ce-type": ["Placed", 5, "Shipped"],
            "not a name": ["x"],
            "x-broken": ["a\r\nb"],
            "x-not-an-array": "y",
        });
        let headers = headers_from_json(&json);
        let values = |name: &str| -> Vec<String> {
            headers
                .get_all(name)
                .map(|value| value.as_str().to_owned())
                .collect()
        };
        assert_eq!(values("ce-id"), ["m-1"]);
        assert_eq!(values("ce-type"), ["Placed", "Shipped"]);
        let names: Vec<&str> = headers.iter().map(|(name, _)| name.as_ref()).collect();
        assert_eq!(names.len(), 2, "only ce-id and ce-type: {names:?}");
        assert!(headers_from_json(&serde_json::json!([1])).is_empty());
    }
}
