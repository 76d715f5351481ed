//! What a consumer reads from a message: its id, event type and version, aggregate,
//! sequence, partition key, conversation and trace, decoded from the headers the relay
//! writes (see [`crate::publisher`]), percent-decoding the `ce-` values as the CloudEvents
//! NATS binding requires (section 3.1.3.2).

use async_nats::HeaderMap;
use async_nats::jetstream;
use percent_encoding::percent_decode_str;

use crate::causality::Traceparent;

/// A message as the handler sees it, beside its decoded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Metadata {
    /// The message id: `ce-id`, else `Nats-Msg-Id`. The inbox records it.
    pub id: String,
    /// `ce-type`.
    pub event_type: String,
    /// `ce-eventversion`; 1 when absent.
    pub event_version: i32,
    /// `ce-aggregatetype`, when present.
    pub aggregate_type: Option<String>,
    /// `ce-subject`: the aggregate id, when present.
    pub aggregate_id: Option<String>,
    /// `ce-sequence`: the event's sequence in its aggregate, when present.
    pub sequence: Option<i64>,
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
        let text = |name: &'static str| decoded(headers, &subject, name);

        let id = match text("ce-id")? {
            Some(id) => id,
            None => decoded(headers, &subject, "Nats-Msg-Id")?.ok_or_else(|| {
                UnreadableMessage::MissingHeader {
                    subject: subject.clone(),
                    header: "ce-id",
                }
            })?,
        };
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
        let event_version =
            i32::try_from(event_version).map_err(|_| UnreadableMessage::InvalidHeader {
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
            event_type,
            event_version,
            aggregate_type: text("ce-aggregatetype")?,
            aggregate_id: text("ce-subject")?,
            sequence,
            partition_key: text("ce-partitionkey")?.unwrap_or_else(|| subject.clone()),
            correlation_id: text("ce-correlationid")?,
            causation_id: text("ce-causationid")?,
            traceparent,
            stream_sequence: info.stream_sequence,
            deliveries: u64::try_from(info.delivered).unwrap_or(1),
            subject,
        })
    }
}

/// The partition key of a message, for routing before it is read in full.
pub(super) fn partition_key(message: &jetstream::Message) -> String {
    let subject = message.subject.to_string();
    message
        .headers
        .as_ref()
        .and_then(|headers| decoded(headers, &subject, "ce-partitionkey").ok().flatten())
        .unwrap_or(subject)
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
/// table.
pub(super) fn headers_json(message: &jetstream::Message) -> serde_json::Value {
    let mut object = serde_json::Map::new();
    if let Some(headers) = &message.headers {
        for (name, values) in headers.iter() {
            let values = values
                .iter()
                .map(|value| serde_json::Value::String(value.as_str().to_owned()))
                .collect();
            object.insert(name.to_string(), serde_json::Value::Array(values));
        }
    }
    serde_json::Value::Object(object)
}
