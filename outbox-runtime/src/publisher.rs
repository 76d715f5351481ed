//! Publishing to NATS JetStream: the wire contract of every message, and the stream.
//!
//! # The wire contract
//!
//! Each outbox row becomes one message on its `subject`. The payload is the event's JSON.
//! The headers carry JetStream's dedup id and the CloudEvents 1.0 attributes in binary
//! content mode, named with the `ce-` prefix and percent-encoded as the CloudEvents NATS
//! protocol binding specifies (section 3.1.3):
//!
//! | header | value |
//! |---|---|
//! | `Nats-Msg-Id` | the row id; JetStream drops a second message with this id inside the stream's duplicate window |
//! | `ce-specversion` | `1.0` |
//! | `ce-id` | the row id (UUID, hyphenated) |
//! | `ce-source` | the relay's configured source URI |
//! | `ce-type` | the event type |
//! | `ce-time` | `occurred_at`, RFC 3339 in UTC |
//! | `ce-subject` | the aggregate id |
//! | `ce-aggregatetype` | the aggregate type |
//! | `ce-sequence` | `aggregate_seq`, zero-padded to 19 digits so that string order is numeric order, as the sequence extension requires |
//! | `ce-partitionkey` | the partition key (partitioning extension) |
//! | `ce-eventversion` | the event version, for decoding the payload |
//! | `ce-correlationid`, `ce-causationid` | the conversation and the cause (see [`crate::causality`]) |
//! | `ce-datacontenttype`, `content-type` | `application/json` |
//!
//! The row's `headers` column is added too: each key becomes a header with the string value,
//! or one value per element of an array of strings. Where a name matches one of the headers
//! above, the contract's value wins.

use std::str::FromStr;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, stream};
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

use crate::outbox::queries::ClaimedEvent;

/// Characters the CloudEvents NATS binding (section 3.1.3.2) requires to be percent-encoded
/// in header values: space, `"`, `%`, and everything outside printable ASCII (`CONTROLS`
/// covers U+0000..U+001F and U+007F; `utf8_percent_encode` always encodes non-ASCII).
const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// Width of `ce-sequence`: `i64::MAX` has 19 digits.
const SEQUENCE_WIDTH: usize = 19;

/// The media type of every payload.
const JSON: &str = "application/json";

/// Why one message was not published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PublishFailure {
    /// The broker could not be reached or did not answer in time: nothing is known to be
    /// wrong with the message. Retried without counting an attempt.
    Transport(String),
    /// The message cannot be published as it is: the broker refused it (no stream for its
    /// subject, over `max_payload`, a stream limit) or its row holds invalid headers. Counts
    /// an attempt.
    Rejected(String),
}

impl PublishFailure {
    fn from_publish_error(error: &PublishError) -> Self {
        let text = error.to_string();
        match error.kind() {
            PublishErrorKind::TimedOut
            | PublishErrorKind::BrokenPipe
            | PublishErrorKind::MaxAckPending => Self::Transport(text),
            PublishErrorKind::StreamNotFound
            | PublishErrorKind::MaxPayloadExceeded
            | PublishErrorKind::WrongLastMessageId
            | PublishErrorKind::WrongLastSequence => Self::Rejected(text),
            // `Other` is a JetStream API error when the server answered (a rejection), and a
            // client-side failure (the connection's command channel) otherwise.
            PublishErrorKind::Other => {
                let from_server = std::error::Error::source(error)
                    .is_some_and(|source| source.is::<jetstream::Error>());
                if from_server {
                    Self::Rejected(text)
                } else {
                    Self::Transport(text)
                }
            }
        }
    }
}

// The header names of the contract, built once (`from_static` values are free to clone).
const CE_SPECVERSION: HeaderName = HeaderName::from_static("ce-specversion");
const CE_ID: HeaderName = HeaderName::from_static("ce-id");
const CE_SOURCE: HeaderName = HeaderName::from_static("ce-source");
const CE_TYPE: HeaderName = HeaderName::from_static("ce-type");
const CE_TIME: HeaderName = HeaderName::from_static("ce-time");
const CE_SUBJECT: HeaderName = HeaderName::from_static("ce-subject");
const CE_AGGREGATETYPE: HeaderName = HeaderName::from_static("ce-aggregatetype");
const CE_SEQUENCE: HeaderName = HeaderName::from_static("ce-sequence");
const CE_PARTITIONKEY: HeaderName = HeaderName::from_static("ce-partitionkey");
const CE_EVENTVERSION: HeaderName = HeaderName::from_static("ce-eventversion");
const CE_CORRELATIONID: HeaderName = HeaderName::from_static("ce-correlationid");
const CE_CAUSATIONID: HeaderName = HeaderName::from_static("ce-causationid");
const CE_DATACONTENTTYPE: HeaderName = HeaderName::from_static("ce-datacontenttype");
const CONTENT_TYPE: HeaderName = HeaderName::from_static("content-type");

/// Builds messages from claimed rows and publishes them with their acks awaited.
pub(crate) struct Publisher {
    jetstream: jetstream::Context,
    source: HeaderValue,
    spec_version: HeaderValue,
    json: HeaderValue,
}

impl Publisher {
    /// A publisher with at most `max_in_flight` publishes awaiting their ack (a publish
    /// beyond waits for a permit: async-nats's backpressure).
    pub(crate) fn new(
        client: async_nats::Client,
        source: &str,
        ack_timeout: Duration,
        max_in_flight: usize,
    ) -> Result<Self, InvalidSource> {
        let source = percent_encoded(source).map_err(|_| InvalidSource(source.to_owned()))?;
        let jetstream = jetstream::ContextBuilder::new()
            .timeout(ack_timeout)
            .max_ack_inflight(max_in_flight)
            .backpressure_on_inflight(true)
            .build(client);
        Ok(Self {
            jetstream,
            source,
            spec_version: HeaderValue::from_static_str("1.0"),
            json: HeaderValue::from_static_str(JSON),
        })
    }

    pub(crate) fn jetstream(&self) -> &jetstream::Context {
        &self.jetstream
    }

    /// Publishes one row and waits for its JetStream ack.
    pub(crate) async fn publish(&self, row: &ClaimedEvent) -> Result<(), PublishFailure> {
        let headers = self.headers(row)?;
        let ack = self
            .jetstream
            .publish_with_headers(row.subject.clone(), headers, row.payload.0.clone())
            .await
            .map_err(|e| PublishFailure::from_publish_error(&e))?;
        std::future::IntoFuture::into_future(ack)
            .await
            .map_err(|e| PublishFailure::from_publish_error(&e))?;
        Ok(())
    }

    /// The headers of a row's message (see the module documentation).
    pub(crate) fn headers(&self, row: &ClaimedEvent) -> Result<HeaderMap, PublishFailure> {
        let mut headers = if row.headers.0.as_slice() == b"{}" {
            HeaderMap::new()
        } else {
            row_headers(&row.headers.0).map_err(PublishFailure::Rejected)?
        };
        let encoded = |value: &str| {
            percent_encoded(value).map_err(|_| {
                PublishFailure::Rejected(format!("header value {value:?} cannot be encoded"))
            })
        };
        let mut id = [0_u8; uuid::fmt::Hyphenated::LENGTH];
        let id = HeaderValue::from_str(row.id.hyphenated().encode_lower(&mut id))
            .expect("a UUID is a valid header value");
        // A row inserted without correlation is its own conversation and cause.
        let correlation = match &row.correlation_id {
            Some(correlation) => encoded(correlation)?,
            None => id.clone(),
        };
        let causation = match &row.causation_id {
            Some(causation) => encoded(causation)?,
            None => id.clone(),
        };
        headers.insert(NATS_MESSAGE_ID, id.clone());
        headers.insert(CE_SPECVERSION, self.spec_version.clone());
        headers.insert(CE_ID, id);
        headers.insert(CE_SOURCE, self.source.clone());
        headers.insert(CE_TYPE, encoded(&row.event_type)?);
        headers.insert(CE_TIME, rfc3339_utc(row.occurred_at));
        headers.insert(CE_SUBJECT, encoded(&row.aggregate_id)?);
        headers.insert(CE_AGGREGATETYPE, encoded(&row.aggregate_type)?);
        headers.insert(CE_SEQUENCE, zero_padded(row.aggregate_seq));
        headers.insert(CE_PARTITIONKEY, encoded(&row.partition_key)?);
        headers.insert(
            CE_EVENTVERSION,
            itoa::Buffer::new().format(row.event_version).to_owned(),
        );
        headers.insert(CE_CORRELATIONID, correlation);
        headers.insert(CE_CAUSATIONID, causation);
        headers.insert(CE_DATACONTENTTYPE, self.json.clone());
        headers.insert(CONTENT_TYPE, self.json.clone());
        Ok(headers)
    }
}

/// `time` in RFC 3339 (section 5.6), in UTC with microseconds, PostgreSQL's precision:
/// `2026-11-21T12:00:00.123456Z`. Written digit by digit: `format!` costs more than the rest
/// of a message's headers.
fn rfc3339_utc(time: time::OffsetDateTime) -> String {
    let t = time.to_offset(time::UtcOffset::UTC);
    let mut text = String::with_capacity(28);
    // A year before 0 or after 9999 is not RFC 3339; PostgreSQL's timestamptz can hold one,
    // and it is written as ISO 8601's expanded form (a sign, more digits) rather than dropped.
    if t.year() < 0 {
        text.push('-');
    }
    let mut digits = |value: u32, width: usize, then: Option<char>| {
        let mut buffer = itoa::Buffer::new();
        let formatted = buffer.format(value);
        text.extend(std::iter::repeat_n(
            '0',
            width.saturating_sub(formatted.len()),
        ));
        text.push_str(formatted);
        text.extend(then);
    };
    digits(t.year().unsigned_abs(), 4, Some('-'));
    digits(u32::from(u8::from(t.month())), 2, Some('-'));
    digits(u32::from(t.day()), 2, Some('T'));
    digits(u32::from(t.hour()), 2, Some(':'));
    digits(u32::from(t.minute()), 2, Some(':'));
    digits(u32::from(t.second()), 2, Some('.'));
    digits(t.microsecond(), 6, Some('Z'));
    text
}

/// `aggregate_seq` zero-padded to [`SEQUENCE_WIDTH`] digits.
fn zero_padded(seq: i64) -> String {
    let mut buffer = itoa::Buffer::new();
    let digits = buffer.format(seq);
    let mut text = String::with_capacity(SEQUENCE_WIDTH.max(digits.len()));
    text.extend(std::iter::repeat_n(
        '0',
        SEQUENCE_WIDTH.saturating_sub(digits.len()),
    ));
    text.push_str(digits);
    text
}

/// A constant header value.
trait FromStaticStr {
    fn from_static_str(value: &'static str) -> Self;
}

impl FromStaticStr for HeaderValue {
    fn from_static_str(value: &'static str) -> Self {
        HeaderValue::from_str(value).expect("a constant header value without CR or LF")
    }
}

/// The relay's `source` cannot be a header value.
#[derive(Debug, thiserror::Error)]
#[error("ce-source {0:?} cannot be sent as a NATS header value")]
pub struct InvalidSource(String);

fn percent_encoded(value: &str) -> Result<HeaderValue, async_nats::header::ParseHeaderValueError> {
    let plain = value
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'%');
    if plain {
        // Printable ASCII other than `"` and `%` is sent as it is: no copy to encode.
        HeaderValue::from_str(value)
    } else {
        HeaderValue::from_str(&utf8_percent_encode(value, HEADER_VALUE).to_string())
    }
}

/// The `headers` column (its JSON text) as NATS headers: each key a header, each value a
/// string or an array of strings. Anything else is an error naming the key.
fn row_headers(column: &[u8]) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    let column: serde_json::Value =
        serde_json::from_slice(column).map_err(|e| format!("headers column is not JSON: {e}"))?;
    let Some(object) = column.as_object() else {
        return Err(format!("headers column is not a JSON object: {column}"));
    };
    for (name, value) in object {
        let header =
            HeaderName::from_str(name).map_err(|e| format!("headers column: key {name:?}: {e}"))?;
        let values = match value {
            serde_json::Value::String(s) => vec![s.as_str()],
            serde_json::Value::Array(items) => items
                .iter()
                .map(|item| item.as_str())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    format!("headers column: key {name:?}: an array holds a non-string value")
                })?,
            other => {
                return Err(format!(
                    "headers column: key {name:?}: expected a string or an array of strings, found {other}"
                ));
            }
        };
        for value in values {
            let value = HeaderValue::from_str(value).map_err(|_| {
                format!("headers column: key {name:?}: value {value:?} contains CR or LF")
            })?;
            headers.append(header.clone(), value);
        }
    }
    Ok(headers)
}

/// Where the relay publishes: the JetStream stream that captures `{prefix}.>`.
#[derive(Clone, Debug)]
pub struct StreamSettings {
    /// The stream name. Default [`DEFAULT_STREAM`].
    pub name: String,
    /// Create the stream when it does not exist; when `false`, a missing stream is an error.
    /// Default `true`.
    pub create: bool,
    /// The duplicate window of a stream the relay creates: JetStream drops a message whose
    /// `Nats-Msg-Id` it stored within this window. Default 2 minutes, JetStream's default
    /// (NATS docs, "Streams", configuration, `Duplicates`). An existing stream keeps its own.
    pub duplicate_window: Duration,
}

/// The default stream name.
pub const DEFAULT_STREAM: &str = "EVENTS";

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            name: DEFAULT_STREAM.to_owned(),
            create: true,
            duplicate_window: Duration::from_secs(120),
        }
    }
}

/// The stream cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The stream does not exist and the relay was told not to create it.
    #[error(
        "JetStream stream {stream:?} does not exist; create it to capture \"{prefix}.>\", \
         or let the relay create it (StreamSettings::create)"
    )]
    Missing {
        /// The stream name.
        stream: String,
        /// The subject prefix it should capture.
        prefix: String,
    },
    /// The stream exists but does not capture the outbox's subjects.
    #[error(
        "JetStream stream {stream:?} captures {subjects:?}, which does not cover \"{prefix}.>\"; \
         add that subject to the stream or point the relay at another stream"
    )]
    DoesNotCapture {
        /// The stream name.
        stream: String,
        /// What it captures.
        subjects: Vec<String>,
        /// The subject prefix it should capture.
        prefix: String,
    },
    /// A JetStream API call failed.
    #[error("JetStream stream {stream:?}: {message}")]
    Api {
        /// The stream name.
        stream: String,
        /// The error reported by async-nats.
        message: String,
    },
}

/// Makes sure the stream exists and captures `{prefix}.>`; returns its configuration.
pub(crate) async fn ensure_stream(
    jetstream: &jetstream::Context,
    settings: &StreamSettings,
    prefix: &str,
) -> Result<stream::Config, StreamError> {
    let api = |message: String| StreamError::Api {
        stream: settings.name.clone(),
        message,
    };
    let wanted = format!("{prefix}.>");
    let info = match jetstream.get_stream(&settings.name).await {
        Ok(mut stream) => stream.info().await.map_err(|e| api(e.to_string()))?.clone(),
        Err(error) => {
            let not_found = matches!(
                error.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref e)
                    if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            );
            if !not_found {
                return Err(api(error.to_string()));
            }
            if !settings.create {
                return Err(StreamError::Missing {
                    stream: settings.name.clone(),
                    prefix: prefix.to_owned(),
                });
            }
            jetstream
                .create_stream(stream::Config {
                    name: settings.name.clone(),
                    subjects: vec![wanted.clone()],
                    duplicate_window: settings.duplicate_window,
                    ..Default::default()
                })
                .await
                .map_err(|e| api(e.to_string()))?
                .cached_info()
                .clone()
        }
    };
    let captured = info
        .config
        .subjects
        .iter()
        .any(|filter| filter_covers_prefix(filter, prefix));
    if !captured {
        return Err(StreamError::DoesNotCapture {
            stream: settings.name.clone(),
            subjects: info.config.subjects.clone(),
            prefix: prefix.to_owned(),
        });
    }
    Ok(info.config)
}

/// Whether the subject filter `filter` matches every subject under `prefix`, i.e. `{prefix}.>`.
fn filter_covers_prefix(filter: &str, prefix: &str) -> bool {
    let mut filter_tokens = filter.split('.');
    for prefix_token in prefix.split('.') {
        match filter_tokens.next() {
            Some(">") => return true,
            Some("*") => {}
            Some(token) if token == prefix_token => {}
            _ => return false,
        }
    }
    filter_tokens.next() == Some(">") && filter_tokens.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ce_time_is_rfc3339_utc_with_microseconds() {
        let time = time::macros::datetime!(2026-11-21 13:04:05.000042 +01:00);
        assert_eq!(rfc3339_utc(time), "2026-11-21T12:04:05.000042Z");
        let time = time::macros::datetime!(0987-01-02 03:04:05 UTC);
        assert_eq!(rfc3339_utc(time), "0987-01-02T03:04:05.000000Z");
        let time = time::macros::datetime!(-0044-03-15 12:00 UTC);
        assert_eq!(rfc3339_utc(time), "-0044-03-15T12:00:00.000000Z");
    }

    #[test]
    fn ce_sequence_is_zero_padded_so_string_order_is_numeric_order() {
        assert_eq!(zero_padded(1), "0000000000000000001");
        assert_eq!(zero_padded(i64::MAX), "9223372036854775807");
        assert!(zero_padded(9) < zero_padded(10));
    }

    #[test]
    fn stream_filters_that_cover_a_prefix() {
        assert!(filter_covers_prefix("events.>", "events"));
        assert!(filter_covers_prefix(">", "events"));
        assert!(filter_covers_prefix("*.>", "events"));
        assert!(filter_covers_prefix("acme.>", "acme.orders"));
        assert!(filter_covers_prefix("acme.orders.>", "acme.orders"));
        assert!(!filter_covers_prefix("events.*", "events"));
        assert!(!filter_covers_prefix("events.Order.>", "events"));
        assert!(!filter_covers_prefix("other.>", "events"));
        assert!(!filter_covers_prefix("events", "events"));
        assert!(!filter_covers_prefix("events.>.x", "events"));
    }

    #[test]
    fn header_values_are_percent_encoded_as_the_binding_says() {
        // The binding's own example (section 3.1.3.2).
        let value = percent_encoded("Euro \u{20ac} \u{1f600}").unwrap();
        assert_eq!(value.as_str(), "Euro%20%E2%82%AC%20%F0%9F%98%80");
        assert_eq!(percent_encoded("a\"b%c").unwrap().as_str(), "a%22b%25c");
        assert_eq!(
            percent_encoded("order-42/x").unwrap().as_str(),
            "order-42/x"
        );
        assert_eq!(percent_encoded("a\r\nb").unwrap().as_str(), "a%0D%0Ab");
        assert_eq!(percent_encoded("caf\u{e9}").unwrap().as_str(), "caf%C3%A9");
        assert_eq!(percent_encoded("a\u{7f}").unwrap().as_str(), "a%7F");
    }

    #[test]
    fn row_headers_take_strings_and_string_arrays_and_name_what_is_wrong() {
        let headers = row_headers(br#"{"traceparent": "00-ab", "x-tag": ["a", "b"]}"#).unwrap();
        assert_eq!(headers.get("traceparent").unwrap().as_str(), "00-ab");
        let tags: Vec<_> = headers.get_all("x-tag").map(|v| v.as_str()).collect();
        assert_eq!(tags, ["a", "b"]);

        let err = row_headers(br#"{"x-n": 1}"#).unwrap_err();
        assert_eq!(
            err,
            "headers column: key \"x-n\": expected a string or an array of strings, found 1"
        );
        let err = row_headers(br#"{"x": "a\nb"}"#).unwrap_err();
        assert!(err.contains("CR or LF"), "{err}");
        let err = row_headers(br#"{"bad name": "v"}"#).unwrap_err();
        assert!(err.starts_with("headers column: key \"bad name\""), "{err}");
    }
}
