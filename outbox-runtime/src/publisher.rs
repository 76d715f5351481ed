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
//! above, in any case (`CE-Sequence` matches `ce-sequence`), the contract's value wins and
//! the row's is left out; a `Nats-` name makes the row a dead letter.

use std::str::FromStr;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, stream};
use async_nats::{Request, RequestError, RequestErrorKind};
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

use crate::outbox::queries::ClaimedEvent;
use crate::subject::validate_subject;

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
    /// The row cannot become a message as it stands: a subject outside the relay's prefix or
    /// with an invalid token or length, a `headers` column that is not headers, or a header
    /// that would steer the server (a `Nats-` name). Never sent; dead-lettered at once, for
    /// an operator to fix and retry.
    Invalid(String),
    /// The broker refused the message (over its `max_payload`, its subject's limit of
    /// messages, a reply that is not a publish ack): counts an attempt. `kind` labels the
    /// rejection in metrics: `refused`, `not_an_ack` or `no_ack`.
    Rejected { kind: &'static str, error: String },
    /// The broker could not be reached, JetStream did not answer (stopping, no stream
    /// leader, the stream missing), or the stream or its account is full ([`is_full`]):
    /// nothing is known to be wrong with the message. Retried without counting an attempt.
    /// `kind` labels it in metrics: `disconnected`, `no_responders`, `unavailable`,
    /// `stream_full` or `no_ack`.
    Transport { kind: &'static str, error: String },
    /// No ack within the ack timeout while the connection stayed up. Either the broker is
    /// slow or stopping (transport), or it dropped the message on purpose (a publish
    /// permission that denies the subject: the server tells only the connection's error
    /// callback), or the stream took it without acking (`no_ack` set on it since the relay
    /// connected, or the ack lost). The relay asks the stream whether it answers, with which
    /// setting, and whether it holds the message, and decides.
    Unacknowledged {
        /// What async-nats reported.
        error: String,
        /// The client's connect count when the publish was sent: a reconnect since then
        /// makes the missing ack a transport failure.
        connects: u64,
    },
}

/// JetStream API errors that say JetStream or the stream is unavailable for now, not that
/// the message is wrong (nats-server `server/errors.json`).
const UNAVAILABLE: &[jetstream::ErrorCode] = &[
    jetstream::ErrorCode::CLUSTER_INCOMPLETE,
    jetstream::ErrorCode::CLUSTER_NO_PEERS,
    jetstream::ErrorCode::CLUSTER_NOT_ACTIVE,
    jetstream::ErrorCode::CLUSTER_NOT_AVAILABLE,
    jetstream::ErrorCode::CLUSTER_NOT_LEADER,
    jetstream::ErrorCode::INSUFFICIENT_RESOURCES,
    jetstream::ErrorCode::JETSTREAM_NOT_ENABLED,
    jetstream::ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
    jetstream::ErrorCode::RAFT_GENERAL,
    jetstream::ErrorCode::STREAM_NOT_FOUND,
    // A stream sealed under a running relay refuses every message for good: the rows wait,
    // in order, for the relay to be pointed at another stream (at connect, a sealed stream
    // is refused: `StreamError::Sealed`), rather than become dead letters one by one.
    jetstream::ErrorCode::STREAM_SEALED,
    jetstream::ErrorCode::TEMP_STORAGE_FAILED,
];

/// JetStream API errors that say the account is at its JetStream limits (storage or memory)
/// and stores no new message until it has room (nats-server `server/errors.json`).
const ACCOUNT_FULL: &[jetstream::ErrorCode] = &[
    jetstream::ErrorCode::ACCOUNT_RESOURCES_EXCEEDED,
    jetstream::ErrorCode::MEMORY_RESOURCES_EXCEEDED,
    jetstream::ErrorCode::STORAGE_RESOURCES_EXCEEDED,
];

/// What a stream with the discard-new policy at its `max_msgs` or `max_bytes` answers, as
/// the description of error code 10077 (`STREAM_STORE_FAILED`): nats-server's `ErrMaxMsgs`
/// and `ErrMaxBytes` (`server/store.go`).
const STREAM_FULL: [&str; 2] = ["maximum messages exceeded", "maximum bytes exceeded"];

/// Whether `error` says the stream ([`STREAM_FULL`]) or its account ([`ACCOUNT_FULL`]) is
/// full. Such a stream refuses every new message until it has room: nothing is wrong with the
/// message, and every row meets the same refusal, so the relay waits for room as for a broker
/// that is away, rather than count attempts that would make every aggregate's head a dead
/// letter. A subject at its own limit (`max_msgs_per_subject` with `discard_new_per_subject`,
/// "maximum messages per subject exceeded") concerns that subject's rows only, and stays a
/// rejection.
fn is_full(error: &jetstream::Error) -> bool {
    let code = error.error_code();
    // The description is private: async-nats shows it first in its `Display`.
    ACCOUNT_FULL.contains(&code)
        || (code == jetstream::ErrorCode::STREAM_STORE_FAILED && {
            let text = error.to_string();
            STREAM_FULL.iter().any(|full| {
                text.strip_prefix(full)
                    .is_some_and(|rest| rest.starts_with(" ("))
            })
        })
}

impl PublishFailure {
    /// Classifies a failed publish request; `connects` is the client's connect count when
    /// the publish was sent.
    fn from_request_error(error: &RequestError, connects: u64) -> Self {
        let text = error.to_string();
        match error.kind() {
            RequestErrorKind::TimedOut => Self::Unacknowledged {
                error: text,
                connects,
            },
            // "No responders": no stream listens on the subject. The relay checked at
            // connect that its stream captures the prefix, and publishes nothing outside it,
            // so this is JetStream stopping (a graceful shutdown disables JetStream before
            // it closes connections) or the stream deleted: the broker's trouble, not the
            // message's.
            RequestErrorKind::NoResponders => Self::Transport {
                kind: "no_responders",
                error: format!(
                    "{text}: JetStream is unavailable or the stream is gone (no stream answered \
                     for the subject)"
                ),
            },
            // Over the server's `max_payload` (the client checks it before sending).
            RequestErrorKind::MaxPayloadExceeded => Self::Rejected {
                kind: "refused",
                error: text,
            },
            RequestErrorKind::InvalidSubject => Self::Invalid(text),
            // The client's command channel closed, or the reply's channel was dropped (the
            // connection lost).
            RequestErrorKind::Other => Self::Transport {
                kind: "disconnected",
                error: text,
            },
        }
    }

    /// A JetStream API error in the reply to a publish.
    fn from_api_error(error: jetstream::Error) -> Self {
        let text = format!("publish failed: {error}");
        if UNAVAILABLE.contains(&error.error_code()) {
            Self::Transport {
                kind: "unavailable",
                error: text,
            }
        } else if is_full(&error) {
            Self::Transport {
                kind: "stream_full",
                error: format!(
                    "{text}: the stream or its account is full and refuses new messages; the \
                     relay retries without counting attempts until it has room (raise the \
                     limit, purge the stream, or let max_age remove old messages)"
                ),
            }
        } else {
            Self::Rejected {
                kind: "refused",
                error: text,
            }
        }
    }
}

/// The reply JetStream sends to a publish: a publish ack (`{"stream":..,"seq":..}`, with
/// `"duplicate":true` when the stream held the `Nats-Msg-Id` already), or an API error
/// (`{"error":{"code":..,"err_code":..,"description":..}}`) (nats-server
/// `server/stream.go`, `JSPubAckResponse`). Read in one pass: async-nats's own reader
/// of it (an untagged enum that tries the error first) buffers the reply and builds a serde
/// error for every ack, 3.4 k instructions of the relay's 52 k per event (callgrind).
#[derive(serde::Deserialize)]
struct PublishReply {
    #[serde(default)]
    error: Option<jetstream::Error>,
    #[serde(default)]
    stream: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    duplicate: bool,
}

/// Whether `reply` acks the publish as a duplicate (`Ok(true)`) or a new message
/// (`Ok(false)`), or why it does not ack it.
fn read_publish_reply(reply: &[u8]) -> Result<bool, PublishFailure> {
    let not_an_ack = |why: String| PublishFailure::Rejected {
        kind: "not_an_ack",
        error: format!("the reply to the publish is not a publish ack: {why}"),
    };
    let reply: PublishReply =
        serde_json::from_slice(reply).map_err(|error| not_an_ack(error.to_string()))?;
    match reply {
        PublishReply {
            error: Some(error), ..
        } => Err(PublishFailure::from_api_error(error)),
        PublishReply {
            stream: Some(_),
            seq: Some(_),
            duplicate,
            ..
        } => Ok(duplicate),
        _ => Err(not_an_ack(
            "it has neither an error nor a stream and a sequence".to_owned(),
        )),
    }
}

/// The header the server reads the dedup id from. nats-server 2.9 takes the *first*
/// occurrence of these bytes anywhere in the header block for it (and finds none when that
/// occurrence is not a header name); later servers take the first that is a header name.
/// Either way the bytes must not appear in any other header, name or value, or data could
/// switch JetStream's dedup off (nats-server `server/client.go`, `getHeader`).
const MSG_ID_BYTES: &str = "Nats-Msg-Id";

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

/// The headers the relay sets on every message, its own values winning over a row's: each
/// row's (in the order `template` lists them) and the constant ones. `Nats-` names are
/// refused in a row's headers altogether; these are dropped from them whatever their case
/// (see [`row_headers`]).
const CONTRACT_HEADERS: [HeaderName; 15] = [
    NATS_MESSAGE_ID,
    CE_ID,
    CE_TYPE,
    CE_TIME,
    CE_SUBJECT,
    CE_AGGREGATETYPE,
    CE_SEQUENCE,
    CE_PARTITIONKEY,
    CE_EVENTVERSION,
    CE_CORRELATIONID,
    CE_CAUSATIONID,
    CE_SPECVERSION,
    CE_SOURCE,
    CE_DATACONTENTTYPE,
    CONTENT_TYPE,
];

/// Builds messages from claimed rows and publishes them with their acks awaited.
pub(crate) struct Publisher {
    client: async_nats::Client,
    /// Only subjects under `{prefix}.` are published.
    prefix: String,
    /// For the stream's API requests (the relay's publishes go through `client`).
    jetstream: jetstream::Context,
    /// How long a publish waits for its ack, from when it is handed to the client.
    ack_timeout: Duration,
    /// Publishes awaiting their ack: at most `max_in_flight` (a publish beyond waits for a
    /// permit).
    in_flight: tokio::sync::Semaphore,
    source: HeaderValue,
    spec_version: HeaderValue,
    json: HeaderValue,
    /// Every header a message of a row without headers of its own carries: the constant ones
    /// with their values, the row's own with an empty list of values. Cloned per message, so
    /// that its map is allocated once at its size and never grows (growing rehashed every
    /// name three times: 14% of the relay's instructions, measured with callgrind); an empty
    /// list clones without an allocation, and frees none when the row's one-value list
    /// replaces it (which costs less than appending to it: a push onto an empty `Vec`
    /// allocates room for four, 3% of the relay's instructions).
    template: HeaderMap,
}

impl Publisher {
    /// A publisher with at most `max_in_flight` publishes awaiting their ack (a publish
    /// beyond waits for one of them to end), each waiting at most `ack_timeout`; the stream's
    /// API requests go to JetStream `domain` (`None`: the connected server's).
    pub(crate) fn new(
        client: async_nats::Client,
        prefix: &str,
        source: &str,
        ack_timeout: Duration,
        max_in_flight: usize,
        domain: Option<&str>,
    ) -> Result<Self, InvalidSource> {
        let source = check_source(source)?;
        let mut jetstream = crate::nats::jetstream_in(client.clone(), domain);
        jetstream.set_timeout(ack_timeout);
        let spec_version = HeaderValue::from_static_str("1.0");
        let json = HeaderValue::from_static_str(JSON);
        let template = template([
            (CE_SPECVERSION, spec_version.clone()),
            (CE_SOURCE, source.clone()),
            (CE_DATACONTENTTYPE, json.clone()),
            (CONTENT_TYPE, json.clone()),
        ]);
        Ok(Self {
            client,
            prefix: prefix.to_owned(),
            jetstream,
            ack_timeout,
            in_flight: tokio::sync::Semaphore::new(max_in_flight),
            source,
            spec_version,
            json,
            template,
        })
    }

    pub(crate) fn jetstream(&self) -> &jetstream::Context {
        &self.jetstream
    }

    /// Publishes one row and waits for its JetStream ack; returns whether JetStream found it
    /// a duplicate (stored already, inside the duplicate window).
    pub(crate) async fn publish(&self, row: &ClaimedEvent) -> Result<bool, PublishFailure> {
        validate_subject(&row.subject, &self.prefix)
            .map_err(|e| PublishFailure::Invalid(e.to_string()))?;
        #[cfg_attr(not(feature = "opentelemetry"), allow(unused_mut))]
        let mut headers = self.headers(row)?;
        #[cfg(feature = "opentelemetry")]
        {
            use tracing::Instrument as _;
            let mut id = [0_u8; uuid::fmt::Hyphenated::LENGTH];
            let span = crate::telemetry::producer_span(
                &row.subject,
                row.id.hyphenated().encode_lower(&mut id),
                row.payload.0.len(),
                &mut headers,
            );
            self.send(row, headers).instrument(span).await
        }
        #[cfg(not(feature = "opentelemetry"))]
        self.send(row, headers).await
    }

    /// Publishes `row`'s payload with `headers` and waits for the ack: a core NATS request
    /// to the subject, which the stream answers once it stored the message (nats-server
    /// `server/stream.go`, `processJetStreamMsg`), its reply read by [`read_publish_reply`].
    async fn send(&self, row: &ClaimedEvent, headers: HeaderMap) -> Result<bool, PublishFailure> {
        let _permit = self
            .in_flight
            .acquire()
            .await
            .expect("the publisher never closes its semaphore");
        let connects = self.connects();
        // One deadline for handing the message over (the client's queue is full while it
        // reconnects) and for its ack, as async-nats's JetStream publish has.
        let request = Request::new()
            .headers(headers)
            .payload(row.payload.0.clone())
            .timeout(None);
        let reply = tokio::time::timeout(
            self.ack_timeout,
            self.client.send_request(row.subject.clone(), request),
        )
        .await
        .map_err(|_elapsed| PublishFailure::Unacknowledged {
            error: format!("no publish ack within {:?}", self.ack_timeout),
            connects,
        })?
        .map_err(|error| PublishFailure::from_request_error(&error, connects))?;
        read_publish_reply(&reply.payload)
    }

    /// How many times the client has connected (the first connect included).
    pub(crate) fn connects(&self) -> u64 {
        self.client
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The client.
    pub(crate) fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The headers of a row's message (see the module documentation).
    pub(crate) fn headers(&self, row: &ClaimedEvent) -> Result<HeaderMap, PublishFailure> {
        let own = row.headers.0.as_slice() != b"{}";
        let mut headers = if own {
            row_headers(&row.headers.0).map_err(PublishFailure::Invalid)?
        } else {
            self.template.clone()
        };
        let encoded = |value: &str| {
            percent_encoded(value).map_err(|_| {
                PublishFailure::Invalid(format!("header value {value:?} cannot be encoded"))
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
        // Over the template's empty lists, and over whatever a row's own headers hold.
        let mut set = |name: HeaderName, value: HeaderValue| headers.insert(name, value);
        set(NATS_MESSAGE_ID, id.clone());
        set(CE_ID, id);
        set(CE_TYPE, encoded(&row.event_type)?);
        set(CE_TIME, rfc3339_utc(row.occurred_at).into());
        set(CE_SUBJECT, encoded(&row.aggregate_id)?);
        set(CE_AGGREGATETYPE, encoded(&row.aggregate_type)?);
        set(CE_SEQUENCE, zero_padded(row.aggregate_seq).into());
        set(CE_PARTITIONKEY, encoded(&row.partition_key)?);
        set(
            CE_EVENTVERSION,
            itoa::Buffer::new().format(row.event_version).into(),
        );
        set(CE_CORRELATIONID, correlation);
        set(CE_CAUSATIONID, causation);
        // The template holds the constant ones; a row's own headers may name them too, and
        // the relay's values win.
        if own {
            headers.insert(CE_SPECVERSION, self.spec_version.clone());
            headers.insert(CE_SOURCE, self.source.clone());
            headers.insert(CE_DATACONTENTTYPE, self.json.clone());
            headers.insert(CONTENT_TYPE, self.json.clone());
        }
        // JetStream refuses a header block over its limit at every attempt. A row's own
        // headers can take it there, and so can a row inserted by hand with long values
        // (the unit of work bounds its tokens and ids, the relay only the subject): the
        // block is summed when the row has headers of its own or its values could reach
        // the limit, percent-encoded (three bytes for each), beside the rest of the block
        // (under 2 KiB: the names, the constant values, the ids, the time, the numbers, and
        // the trace context a producer span adds after this check). The exact sum cannot
        // count that context (at most 55 + 512 bytes, W3C Trace Context): a block within it
        // of the limit is refused by the server, and retried as any rejection.
        let could_reach_the_limit = || {
            let values = row.aggregate_type.len()
                + row.aggregate_id.len()
                + row.event_type.len()
                + row.partition_key.len()
                + row.correlation_id.as_ref().map_or(0, String::len)
                + row.causation_id.as_ref().map_or(0, String::len);
            3 * values + self.source.as_str().len() + 2048 > MAX_HEADER_BLOCK_BYTES
        };
        if own || could_reach_the_limit() {
            let block = header_block_len(&headers);
            if block > MAX_HEADER_BLOCK_BYTES {
                return Err(PublishFailure::Invalid(format!(
                    "the message's headers would be {block} bytes, over JetStream's limit of \
                     {MAX_HEADER_BLOCK_BYTES} (nats-server stores a header block's length in \
                     16 bits and refuses a longer one, error code 10097)"
                )));
            }
        }
        Ok(headers)
    }
}

/// The most bytes a message's header block may take in a JetStream stream: nats-server
/// stores its length in 16 bits and refuses a longer block with
/// `JSStreamHeaderExceedsMaximumErr` (error code 10097; `server/stream.go`, the check on
/// `len(hdr) > math.MaxUint16`), on 2.9 as on 2.15.
pub(crate) const MAX_HEADER_BLOCK_BYTES: usize = u16::MAX as usize;

/// The length of the header block async-nats sends for `headers`: `NATS/1.0\r\n`, a
/// `name: value\r\n` line per value, and a closing `\r\n` (async-nats, `header.rs`). An
/// `HPUB` counts it into the server's `max_payload`, and a stream stores it whole.
fn header_block_len(headers: &HeaderMap) -> usize {
    let lines: usize = headers
        .iter()
        .map(|(name, values)| {
            let name = AsRef::<str>::as_ref(name).len();
            values
                .iter()
                .map(|value| name + ": ".len() + value.as_str().len() + "\r\n".len())
                .sum::<usize>()
        })
        .sum();
    "NATS/1.0\r\n".len() + lines + "\r\n".len()
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

/// The relay's `source` cannot be its messages' `ce-source`.
#[derive(Debug, thiserror::Error)]
#[error("ce-source {value:?} is not usable: {reason}")]
pub struct InvalidSource {
    /// The configured source, cut to 128 bytes.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

/// `source` as the `ce-source` header's value, or why it cannot be one.
pub(crate) fn check_source(source: &str) -> Result<HeaderValue, InvalidSource> {
    let invalid = |reason: &str| InvalidSource {
        value: crate::subject::shortened(source, 128),
        reason: reason.to_owned(),
    };
    // CloudEvents 1.0, section 3.1.1: source is a non-empty URI-reference.
    if source.is_empty() {
        return Err(invalid("CloudEvents requires a non-empty source"));
    }
    if source.len() > crate::causality::MAX_ID_BYTES {
        return Err(invalid(&format!(
            "it is {} bytes long, over the limit of {} bytes a consumer keys messages by",
            source.len(),
            crate::causality::MAX_ID_BYTES
        )));
    }
    percent_encoded(source).map_err(|_| invalid("it cannot be a NATS header value"))
}

/// A `ce-` header value, percent-encoded as the CloudEvents NATS binding requires, and with
/// the `N` of any `Nats-Msg-Id` in it encoded too (`%4E`, which every binding-conformant
/// reader decodes back), so that the value cannot pass for the dedup header (see
/// [`MSG_ID_BYTES`]).
fn percent_encoded(value: &str) -> Result<HeaderValue, async_nats::header::ParseHeaderValueError> {
    let plain = value
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'%');
    let steers = value.contains(MSG_ID_BYTES);
    if plain && !steers {
        // Printable ASCII other than `"` and `%` is sent as it is: no copy to encode.
        return HeaderValue::from_str(value);
    }
    let mut encoded = utf8_percent_encode(value, HEADER_VALUE).to_string();
    if steers {
        encoded = encoded.replace(MSG_ID_BYTES, "%4Eats-Msg-Id");
    }
    HeaderValue::from_str(&encoded)
}

/// The headers a row's values go into (each with an empty list of values), and the
/// `constant` ones with their values.
///
/// `HeaderMap` has no way to hold a name without a value but its `Deserialize`, which takes
/// the map of names to lists of values that its `Serialize` gives (async-nats, `header.rs`).
fn template(constant: [(HeaderName, HeaderValue); 4]) -> HeaderMap {
    let constant_names = constant.clone().map(|(name, _)| name);
    let per_row = CONTRACT_HEADERS
        .into_iter()
        .filter(|name| !constant_names.contains(name));
    let lists: std::collections::HashMap<HeaderName, Vec<HeaderValue>> = per_row
        .map(|name| (name, Vec::new()))
        .chain(
            constant
                .into_iter()
                .map(|(name, value)| (name, vec![value])),
        )
        .collect();
    let json = serde_json::to_value(lists).expect("header names and values serialize");
    serde_json::from_value(json).expect("a HeaderMap deserializes from its own serialization")
}

/// The `headers` column (its JSON text) as NATS headers: each key a header, each value a
/// string or an array of strings. Anything else is an error naming the key, as is a key that
/// is not an HTTP token ([`is_token`]) and a value holding a control character other than a
/// tab (RFC 9110 section 5.5: CR, LF and NUL would end or corrupt the header block, the
/// others are not field content either). A value's leading and trailing whitespace is sent
/// as it is, and readers may trim it, as HTTP's does (section 5.5 again; async-nats trims
/// both ends, nats.go the start). A key that names
/// one of the [`CONTRACT_HEADERS`] in any case is left out: the relay sets that header, and a
/// reader that compares names without case (as HTTP's, which the CloudEvents bindings follow,
/// does) would otherwise see two values, one of them the row's (`CE-Sequence: 999` beside
/// the relay's `ce-sequence`).
fn row_headers(column: &[u8]) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    let column: serde_json::Value =
        serde_json::from_slice(column).map_err(|e| format!("headers column is not JSON: {e}"))?;
    let Some(object) = column.as_object() else {
        return Err(format!("headers column is not a JSON object: {column}"));
    };
    for (name, value) in object {
        // The server acts on `Nats-` headers (dedup, expected sequences, rollups that purge a
        // subject, TTLs, batches): a row must not carry one.
        let server_header = name
            .get(..5)
            .is_some_and(|start| start.eq_ignore_ascii_case("nats-"));
        if server_header || name.contains(MSG_ID_BYTES) {
            return Err(format!(
                "headers column: key {name:?}: Nats- headers are the server's (dedup, expected \
                 sequences, rollups); a row may not set one"
            ));
        }
        if CONTRACT_HEADERS
            .iter()
            .any(|contract| AsRef::<str>::as_ref(contract).eq_ignore_ascii_case(name))
        {
            continue;
        }
        if !is_token(name) {
            return Err(format!(
                "headers column: key {name:?}: a header name is one or more letters, digits or \
                 any of !#$%&'*+-.^_`|~ (an HTTP token, RFC 9110 section 5.1; NATS headers are \
                 HTTP's), or readers see the message differently"
            ));
        }
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
            if value.contains(MSG_ID_BYTES) {
                return Err(format!(
                    "headers column: key {name:?}: the value contains \"{MSG_ID_BYTES}\", which \
                     nats-server 2.9 would take for the dedup header"
                ));
            }
            if value.chars().any(|c| c.is_ascii_control() && c != '\t') {
                return Err(format!(
                    "headers column: key {name:?}: value {value:?} contains a control character \
                     (CR, LF, NUL, ...), which a header value may not (RFC 9110 section 5.5)"
                ));
            }
            let value = HeaderValue::from_str(value)
                .map_err(|e| format!("headers column: key {name:?}: value {value:?}: {e}"))?;
            headers.append(header.clone(), value);
        }
    }
    Ok(headers)
}

/// Whether `name` is an HTTP token (RFC 9110 section 5.1, `field-name = token`; section
/// 5.6.2, `token = 1*tchar`), what a header name must be: NATS headers are HTTP's (NATS ADR-4,
/// "NATS Headers"). async-nats takes any visible ASCII but `:`, and the empty name; readers
/// differ on the rest: nats.go's (and nats-server's) skip a header of empty name where
/// async-nats's keep it, and an HTTP reader (a gateway, a CloudEvents HTTP binding) refuses a
/// name that is not a token.
fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Where the relay publishes: the JetStream stream that captures `{prefix}.>`, and what an
/// operator sets on it.
///
/// A stream the relay creates gets these settings. An existing stream keeps its own (the
/// operator's, changed with `nats stream edit`): each setting that differs is reported at
/// start-up as a warning that names the stream, the setting and both values.
#[derive(Clone, Debug)]
pub struct StreamSettings {
    /// The stream name. Default [`DEFAULT_STREAM`]. A relay refuses, naming the rule, a name
    /// nats-server would refuse: empty, over 255 bytes, or holding whitespace, `.`, `*`, `>`,
    /// `/`, `\\` or a control character.
    pub name: String,
    /// Create the stream when it does not exist; when `false`, a missing stream is an error.
    /// Default `true`.
    pub create: bool,
    /// The duplicate window: JetStream drops a message whose `Nats-Msg-Id` it stored within
    /// this window. Default 2 minutes, JetStream's default (NATS docs, "Streams",
    /// configuration, `Duplicates`). At most `i64::MAX` nanoseconds (about 292 years), as
    /// the JetStream API carries it; a relay refuses a longer one at start-up, and zero
    /// (nats-server would store its default instead), or one longer than a non-zero
    /// `max_age` (nats-server refuses that stream). nats-server keeps the id of each message
    /// stored within the window in memory, 115-252 bytes an id (BENCHMARKS.md, "Replaying
    /// the archive"): a relay publishing 30,000 events/s holds 3.6 million ids in a 2-minute
    /// window, 0.4-0.9 GB of the server's memory.
    pub duplicate_window: Duration,
    /// How many servers of a cluster hold the stream (1 to 5, refused otherwise at a
    /// relay's start-up; a single server takes 1). Default 1.
    pub replicas: usize,
    /// Where the stream keeps its messages. Default [`StorageType::File`], which survives a
    /// server restart.
    pub storage: StorageType,
    /// How long the stream keeps a message; zero keeps it until a limit removes it. Default
    /// zero. At most `i64::MAX` nanoseconds, as `duplicate_window`; when not zero, at least
    /// 100 ms, nats-server's least (its error "max age needs to be >= 100ms").
    pub max_age: Duration,
    /// The most bytes the stream holds; -1 for no limit. Default -1. A relay refuses 0 and
    /// values below -1 at start-up.
    pub max_bytes: i64,
    /// The JetStream domain the stream lives in, for a relay or an inbox connected to a
    /// server of another domain: a leaf node whose hub holds the stream, say (NATS docs,
    /// "JetStream on Leaf Nodes"). With `Some("hub")` the stream's API requests (its
    /// creation, its info, an inbox's consumer and pulls) go to `$JS.hub.API.>`, which the
    /// servers of domain `hub` answer wherever the client is connected; publishes need no
    /// domain: they reach the stream by its subjects. Default `None`: the JetStream of the
    /// server the client is connected to (`$JS.API.>`). A domain is one subject token (no
    /// `.`, `*`, `>` or whitespace, as nats-server requires of its `domain` setting); a
    /// relay and an inbox refuse another at start-up.
    pub domain: Option<String>,
}

pub use async_nats::jetstream::stream::StorageType;

/// The default stream name.
pub const DEFAULT_STREAM: &str = "EVENTS";

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            name: DEFAULT_STREAM.to_owned(),
            create: true,
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
            storage: StorageType::File,
            max_age: Duration::ZERO,
            max_bytes: -1,
            domain: None,
        }
    }
}

impl StreamSettings {
    /// The first setting a stream would not take as it is, as an error that names it
    /// (`"replicas 0 is not 1 to 5, ..."`). The JetStream API carries a stream's durations
    /// as int64 nanoseconds (about 292 years), and a longer one wraps: nats-server answers
    /// that it is negative. nats-server 2.9 stores 0 replicas as 1 and a `max_bytes` of 0 as
    /// -1 (a relay's next start would report the difference), refuses more than 5 replicas,
    /// and keeps a `max_bytes` below -1 as no limit, which these settings spell -1.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.check_address()?;
        let longest = Duration::from_nanos(i64::MAX.unsigned_abs());
        for (name, value) in [
            ("duplicate_window", self.duplicate_window),
            ("max_age", self.max_age),
        ] {
            if value > longest {
                return Err(format!(
                    "{name} {value:?} is longer than JetStream takes: at most {longest:?} \
                     (int64 nanoseconds)"
                ));
            }
        }
        if self.duplicate_window.is_zero() {
            return Err(
                "duplicate_window 0ns is no window: nats-server would store its own default (2 \
                 min) instead, and the relay report the difference at its next start"
                    .to_owned(),
            );
        }
        if !self.max_age.is_zero() && self.max_age < Duration::from_millis(100) {
            return Err(format!(
                "max_age {:?} is shorter than nats-server takes: at least 100ms, or zero for no \
                 limit",
                self.max_age
            ));
        }
        if !self.max_age.is_zero() && self.duplicate_window > self.max_age {
            return Err(format!(
                "duplicate_window {:?} is longer than max_age {:?}: nats-server refuses a \
                 stream that forgets a message before its duplicates",
                self.duplicate_window, self.max_age
            ));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(format!(
                "replicas {} is not 1 to 5, what a JetStream stream takes",
                self.replicas
            ));
        }
        if self.max_bytes != -1 && self.max_bytes < 1 {
            return Err(format!(
                "max_bytes {} is neither -1 (no limit) nor a positive number of bytes",
                self.max_bytes
            ));
        }
        Ok(())
    }

    /// The first fault of the stream's name
    /// ([`validate_stream_name`](crate::subject::validate_stream_name)) or of its domain (one
    /// subject token: [`validate_token`](crate::subject::validate_token)), as an error that
    /// names the setting.
    pub(crate) fn check_address(&self) -> Result<(), String> {
        crate::subject::validate_stream_name(&self.name)
            .map_err(|error| format!("name {error}"))?;
        if let Some(domain) = &self.domain {
            crate::subject::validate_token(domain).map_err(|reason| {
                format!(
                    "domain {:?} is not a JetStream domain: {reason}",
                    crate::subject::shortened(domain, 64)
                )
            })?;
        }
        Ok(())
    }

    /// The stream's JetStream API through `client`, in [`domain`](Self::domain):
    /// [`crate::nats::jetstream_in`].
    pub(crate) fn jetstream(&self, client: async_nats::Client) -> jetstream::Context {
        crate::nats::jetstream_in(client, self.domain.as_deref())
    }

    /// The text of a failed API request about the stream:
    /// [`crate::nats::jetstream_error_text_in`] its domain.
    pub(crate) fn api_error_text(&self, error: &(dyn std::error::Error + 'static)) -> String {
        crate::nats::jetstream_error_text_in(error, self.domain.as_deref())
    }

    /// The settings of `config` that differ from these: `(setting, the stream's value, these
    /// settings' value)`.
    pub fn differences(&self, config: &stream::Config) -> Vec<(&'static str, String, String)> {
        let mut differences = Vec::new();
        let mut compare = |setting, actual: String, wanted: String| {
            if actual != wanted {
                differences.push((setting, actual, wanted));
            }
        };
        compare(
            "duplicate_window",
            format!("{:?}", config.duplicate_window),
            format!("{:?}", self.duplicate_window),
        );
        compare(
            "replicas",
            config.num_replicas.max(1).to_string(),
            self.replicas.max(1).to_string(),
        );
        compare(
            "storage",
            format!("{:?}", config.storage),
            format!("{:?}", self.storage),
        );
        compare(
            "max_age",
            format!("{:?}", config.max_age),
            format!("{:?}", self.max_age),
        );
        compare(
            "max_bytes",
            config.max_bytes.to_string(),
            self.max_bytes.to_string(),
        );
        differences
    }
}

/// Where a stream was looked for, for an error: ` in JetStream domain "hub"`, or nothing
/// without a domain.
pub(crate) fn in_domain(domain: Option<&str>) -> String {
    domain.map_or_else(String::new, |domain| {
        format!(" in JetStream domain {domain:?}")
    })
}

/// The stream cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The stream does not exist and the relay was told not to create it.
    #[error(
        "JetStream stream {stream:?} does not exist{}; create it to capture \"{prefix}.>\", \
         or let the relay create it (StreamSettings::create)",
        in_domain(domain.as_deref())
    )]
    Missing {
        /// The stream name.
        stream: String,
        /// The subject prefix it should capture.
        prefix: String,
        /// The JetStream domain the relay looked in ([`StreamSettings::domain`]), if any.
        domain: Option<String>,
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
    /// The stream does not acknowledge publishes (its `no_ack` setting): the relay could
    /// never learn that an event was stored, and would count each as refused.
    #[error(
        "JetStream stream {stream:?} does not acknowledge publishes (no_ack): the relay \
         deletes an event only once the stream acks it; create the stream without no_ack, or \
         point the relay at another stream"
    )]
    NoAck {
        /// The stream name.
        stream: String,
    },
    /// The stream is sealed: it refuses every publish, and a stream cannot be unsealed
    /// (nats-server, "Stream configuration": `sealed`).
    #[error(
        "JetStream stream {stream:?} is sealed and refuses every publish; point the relay at \
         another stream"
    )]
    Sealed {
        /// The stream name.
        stream: String,
    },
    /// The stream does not exist, and creating it failed because another stream captures
    /// some of its subjects: a subject belongs to one stream of an account (JetStream's error
    /// 10065, "subjects overlap with an existing stream").
    #[error(
        "JetStream stream {stream:?} cannot be created to capture \"{prefix}.>\": the stream \
         {other:?} captures {other_subjects:?}, which overlap it, and a subject is stored by one \
         stream only; point the relay at {other:?} (StreamSettings::name, outbox relay \
         --stream) if it is this outbox's, or give this topology another prefix"
    )]
    Overlaps {
        /// The stream name.
        stream: String,
        /// The subject prefix it should capture.
        prefix: String,
        /// A stream that captures some of the prefix's subjects.
        other: String,
        /// What that stream captures.
        other_subjects: Vec<String>,
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

/// Makes sure the stream exists and captures `{prefix}.>`; returns its configuration. Each
/// JetStream API request waits at most `timeout` (the relay's `ack_timeout`, its JetStream
/// context's), and an error says so when one did not come back in it.
pub(crate) async fn ensure_stream(
    jetstream: &jetstream::Context,
    settings: &StreamSettings,
    prefix: &str,
    timeout: Duration,
) -> Result<stream::Config, StreamError> {
    let api = |message: String| StreamError::Api {
        stream: settings.name.clone(),
        message,
    };
    // A request the server never answered says how long it waited, and what set that.
    let failed = |error: &(dyn std::error::Error + 'static)| {
        if request_timed_out(error) {
            api(format!(
                "{error}: no answer within {timeout:?}, the relay's ack_timeout, which bounds \
                 its JetStream API requests too"
            ))
        } else {
            api(settings.api_error_text(error))
        }
    };
    let wanted = format!("{prefix}.>");
    let info = match jetstream.get_stream(&settings.name).await {
        Ok(mut stream) => stream.info().await.map_err(|e| failed(&e))?.clone(),
        Err(error) => {
            if !crate::nats::stream_not_found(&error) {
                return Err(failed(&error));
            }
            if !settings.create {
                return Err(StreamError::Missing {
                    stream: settings.name.clone(),
                    prefix: prefix.to_owned(),
                    domain: settings.domain.clone(),
                });
            }
            let created = jetstream
                .create_stream(stream::Config {
                    name: settings.name.clone(),
                    subjects: vec![wanted.clone()],
                    duplicate_window: settings.duplicate_window,
                    num_replicas: settings.replicas,
                    storage: settings.storage,
                    max_age: settings.max_age,
                    max_bytes: settings.max_bytes,
                    ..Default::default()
                })
                .await;
            match created {
                Ok(stream) => stream.cached_info().clone(),
                Err(error) => {
                    return Err(match overlapping(jetstream, &error, &wanted).await {
                        Some((other, other_subjects)) => StreamError::Overlaps {
                            stream: settings.name.clone(),
                            prefix: prefix.to_owned(),
                            other,
                            other_subjects,
                        },
                        None => failed(&error),
                    });
                }
            }
        }
    };
    if !captures(&info.config.subjects, prefix) {
        return Err(StreamError::DoesNotCapture {
            stream: settings.name.clone(),
            subjects: info.config.subjects.clone(),
            prefix: prefix.to_owned(),
        });
    }
    if info.config.no_ack {
        return Err(StreamError::NoAck {
            stream: settings.name.clone(),
        });
    }
    if info.config.sealed {
        return Err(StreamError::Sealed {
            stream: settings.name.clone(),
        });
    }
    for (setting, actual, wanted) in settings.differences(&info.config) {
        tracing::warn!(
            stream = %settings.name,
            setting,
            stream_has = %actual,
            settings_say = %wanted,
            "the JetStream stream differs from the relay's StreamSettings and keeps its own \
             value; change the stream (nats stream edit) or the settings"
        );
    }
    Ok(info.config)
}

/// When a stream's creation failed because another stream captures some of `subjects`
/// (10065), that stream's name and subjects, as JetStream's stream list filtered by
/// `subjects` gives them (it lists the streams whose subjects collide with the filter:
/// checked on nats-server 2.9.10 and 2.15.1); `None` for another failure, or when the look
/// up fails too.
async fn overlapping(
    jetstream: &jetstream::Context,
    error: &jetstream::context::CreateStreamError,
    subjects: &str,
) -> Option<(String, Vec<String>)> {
    use jetstream::context::CreateStreamErrorKind;
    let CreateStreamErrorKind::JetStream(error) = error.kind() else {
        return None;
    };
    if error.error_code() != jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP {
        return None;
    }
    let other = jetstream.stream_by_subject(subjects).await.ok()?;
    let stream = jetstream.get_stream(&other).await.ok()?;
    let other_subjects = stream.cached_info().config.subjects.clone();
    Some((other, other_subjects))
}

/// Whether `error` is, or was caused by, a JetStream API request that timed out (a stream
/// creation's error keeps only its kind).
fn request_timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    use jetstream::context::{CreateStreamError, CreateStreamErrorKind, RequestError};
    let mut cause = Some(error);
    while let Some(error) = cause {
        let request = error.downcast_ref::<RequestError>().map(RequestError::kind);
        let create = error
            .downcast_ref::<CreateStreamError>()
            .map(CreateStreamError::kind);
        if request == Some(jetstream::context::RequestErrorKind::TimedOut)
            || create == Some(CreateStreamErrorKind::TimedOut)
        {
            return true;
        }
        cause = error.source();
    }
    false
}

/// Whether a stream with the subject filters `subjects` captures every subject under
/// `prefix`, i.e. `{prefix}.>` (one of its filters does).
pub(crate) fn captures(subjects: &[String], prefix: &str) -> bool {
    subjects
        .iter()
        .any(|filter| filter_covers_prefix(filter, prefix))
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
    fn the_template_takes_each_rows_value_under_its_name_once() {
        let constant = HeaderValue::from_static_str("c");
        let template = template([
            (CE_SPECVERSION, constant.clone()),
            (CE_SOURCE, constant.clone()),
            (CE_DATACONTENTTYPE, constant.clone()),
            (CONTENT_TYPE, constant),
        ]);
        assert_eq!(template.len(), 15);
        let mut headers = template.clone();
        for name in [NATS_MESSAGE_ID, CE_ID, CE_EVENTVERSION, CE_CAUSATIONID] {
            assert_eq!(headers.get_all(name.clone()).count(), 0, "{name:?}");
            headers.append(name.clone(), "v");
            assert_eq!(headers.get_all(name.clone()).count(), 1, "{name:?}");
        }
        assert_eq!(headers.len(), 15, "no name was added beside its empty list");
        assert_eq!(headers.get(CE_SOURCE).map(HeaderValue::as_str), Some("c"));
    }

    /// `DEFAULT_MAX_PAYLOAD_BYTES` leaves 16 KiB of nats-server's default 1 MiB for the
    /// relay's headers: a row whose every token, id and the relay's `ce-source` are at their
    /// longest and each byte percent-encoded (`é`: 2 bytes, 6 characters), with the
    /// OpenTelemetry headers at theirs (W3C Trace Context: a 55-character `traceparent`, a
    /// `tracestate` of at most 512), fits in it.
    #[tokio::test]
    async fn the_relays_longest_headers_fit_in_what_the_payload_bound_leaves() {
        use crate::causality::MAX_ID_BYTES;
        use crate::subject::MAX_TOKEN_BYTES;
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect("nats://127.0.0.1:1")
            .await
            .unwrap();
        let encoded = |bytes: usize| "é".repeat(bytes / 2);
        let publisher = Publisher::new(
            client,
            "events",
            &encoded(MAX_ID_BYTES),
            Duration::from_secs(1),
            1,
            None,
        )
        .unwrap();
        let row = ClaimedEvent {
            id: uuid::Uuid::now_v7(),
            aggregate_type: encoded(MAX_TOKEN_BYTES),
            aggregate_id: encoded(MAX_TOKEN_BYTES),
            aggregate_seq: i64::MAX,
            event_type: encoded(MAX_TOKEN_BYTES),
            event_version: i32::MAX,
            partition_key: encoded(MAX_TOKEN_BYTES),
            subject: String::new(),
            payload: crate::outbox::queries::JsonBytes(bytes::Bytes::from_static(b"{}")),
            headers: crate::outbox::queries::JsonText(b"{}".to_vec()),
            occurred_at: time::macros::datetime!(-9999-12-31 23:59:59.999999 UTC),
            correlation_id: Some(encoded(MAX_ID_BYTES)),
            causation_id: Some(encoded(MAX_ID_BYTES)),
            available: true,
        };
        let headers = publisher.headers(&row).unwrap();
        assert!(
            headers
                .get(CE_SOURCE)
                .unwrap()
                .as_str()
                .starts_with("%C3%A9"),
            "percent-encoded"
        );
        let block = header_block_len(&headers);
        let trace_context = "traceparent: \r\n".len() + 55 + "tracestate: \r\n".len() + 512;
        let left = 1024 * 1024 - crate::outbox::DEFAULT_MAX_PAYLOAD_BYTES;
        assert!(
            block + trace_context <= left,
            "{block} + {trace_context} bytes of headers, {left} left by the payload bound"
        );
        // Four tokens (type, aggregate type and id, partition key) and three ids (correlation,
        // causation, source), each byte sent as three characters.
        let encoded_values = 4 * 3 * MAX_TOKEN_BYTES + 3 * 3 * MAX_ID_BYTES;
        assert!(
            block > encoded_values,
            "{block}: the row is not at its longest"
        );
    }

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
    fn no_value_can_pass_for_the_dedup_header() {
        let value = percent_encoded("Nats-Msg-Id-1").unwrap();
        assert_eq!(value.as_str(), "%4Eats-Msg-Id-1");
        let value = percent_encoded("Nats-Msg-Id:x Nats-Msg-Id").unwrap();
        assert_eq!(value.as_str(), "%4Eats-Msg-Id:x%20%4Eats-Msg-Id");
        let decoded = percent_encoding::percent_decode_str(value.as_str())
            .decode_utf8()
            .unwrap();
        assert_eq!(
            decoded, "Nats-Msg-Id:x Nats-Msg-Id",
            "a reader decodes it back"
        );

        for (column, wanted) in [
            (
                r#"{"Nats-Rollup": "all"}"#,
                "Nats- headers are the server's",
            ),
            (r#"{"nats-msg-id": "x"}"#, "Nats- headers are the server's"),
            (
                r#"{"X-Nats-Msg-Id": "x"}"#,
                "Nats- headers are the server's",
            ),
            (
                r#"{"x-tag": "Nats-Msg-Id: 1"}"#,
                "take for the dedup header",
            ),
        ] {
            let error = row_headers(column.as_bytes()).unwrap_err();
            assert!(error.contains(wanted), "{column}: {error}");
        }
    }

    #[test]
    fn publish_errors_are_classified_by_what_they_say_about_the_message() {
        let error = RequestError::new(RequestErrorKind::TimedOut);
        assert_eq!(
            PublishFailure::from_request_error(&error, 3),
            PublishFailure::Unacknowledged {
                error: error.to_string(),
                connects: 3
            }
        );
        let error = RequestError::new(RequestErrorKind::NoResponders);
        assert!(matches!(
            PublishFailure::from_request_error(&error, 1),
            PublishFailure::Transport {
                kind: "no_responders",
                ..
            }
        ));
        let error = RequestError::new(RequestErrorKind::MaxPayloadExceeded);
        assert!(matches!(
            PublishFailure::from_request_error(&error, 1),
            PublishFailure::Rejected { kind: "refused", error } if error.contains("max payload")
        ));
        let error = RequestError::new(RequestErrorKind::Other);
        assert!(matches!(
            PublishFailure::from_request_error(&error, 1),
            PublishFailure::Transport {
                kind: "disconnected",
                ..
            }
        ));
        let error = RequestError::new(RequestErrorKind::InvalidSubject);
        assert!(matches!(
            PublishFailure::from_request_error(&error, 1),
            PublishFailure::Invalid(_)
        ));
    }

    /// The replies nats-server sends to a publish (captured from 2.9.10 and 2.15.1: a new
    /// message, a duplicate, a stream at its `max_msgs` with `discard: new`), and what is
    /// not a publish ack.
    #[test]
    fn publish_replies_are_acks_api_errors_or_not_acks() {
        assert_eq!(
            read_publish_reply(br#"{"stream":"CAPTURE", "seq":1}"#),
            Ok(false)
        );
        assert_eq!(
            read_publish_reply(br#"{"stream":"CAPTURE","seq":1}"#),
            Ok(false)
        );
        assert_eq!(
            read_publish_reply(br#"{"stream":"CAPTURE", "seq":1,"duplicate": true}"#),
            Ok(true)
        );
        assert_eq!(
            read_publish_reply(br#"{"stream":"EVENTS","domain":"hub","seq":7,"duplicate":false}"#),
            Ok(false)
        );
        // A store that failed: the message is not stored, whatever else the reply holds. A
        // stream or an account at its limits refuses every message until it has room: a
        // transport failure; a subject at its own limit, or another store failure, refuses
        // this message: a rejection.
        let refusal = |code: u64, description: &str| {
            let reply = format!(
                r#"{{"error":{{"code":503,"err_code":{code},"description":"{description}"}},"stream":"CAPTURE","seq":0}}"#
            );
            read_publish_reply(reply.as_bytes()).unwrap_err()
        };
        for (code, description) in [
            (10077, "maximum messages exceeded"),
            (10077, "maximum bytes exceeded"),
            (10002, "resource limits exceeded for account"),
            (10028, "insufficient memory resources available"),
            (10047, "insufficient storage resources available"),
        ] {
            let full = refusal(code, description);
            assert!(
                matches!(&full, PublishFailure::Transport { kind: "stream_full", error }
                    if error.contains(description) && error.contains(&code.to_string())
                        && error.contains("retries without counting attempts")),
                "{full:?}"
            );
        }
        for (code, description) in [
            (10077, "maximum messages per subject exceeded"),
            (10077, "message to large"),
            (10077, "maximum messages exceeded, and more"),
            (10054, "maximum messages exceeded"),
        ] {
            let refused = refusal(code, description);
            assert!(
                matches!(&refused, PublishFailure::Rejected { kind: "refused", error }
                    if error.contains(description) && error.contains(&code.to_string())),
                "{refused:?}"
            );
        }
        for reply in [
            &br#"{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}"#[..],
            br#"{"error":{"code":400,"err_code":10109,"description":"invalid operation on sealed stream"}}"#,
        ] {
            let unavailable = read_publish_reply(reply).unwrap_err();
            assert!(
                matches!(
                    unavailable,
                    PublishFailure::Transport {
                        kind: "unavailable",
                        ..
                    }
                ),
                "{unavailable:?}"
            );
        }
        for reply in [
            &b""[..],
            b"+OK",
            b"{}",
            br#"{"stream":"EVENTS"}"#,
            br#"{"seq":7}"#,
            br#"{"stream":"EVENTS","seq":-1}"#,
            br#"{"stream":"EVENTS","seq":7,"duplicate":"yes"}"#,
            br#"{"error":{"description":"no code"}}"#,
            b"[1]",
        ] {
            let failure = read_publish_reply(reply).unwrap_err();
            assert!(
                matches!(&failure, PublishFailure::Rejected { kind: "not_an_ack", error }
                    if error.contains("not a publish ack")),
                "{}: {failure:?}",
                String::from_utf8_lossy(reply)
            );
        }
    }

    #[test]
    fn row_headers_take_strings_and_string_arrays_and_name_what_is_wrong() {
        let headers = row_headers(br#"{"traceparent": "00-ab", "x-tag": ["a", "b"]}"#).unwrap();
        assert_eq!(headers.get("traceparent").unwrap().as_str(), "00-ab");
        let tags: Vec<_> = headers.get_all("x-tag").map(|v| v.as_str()).collect();
        assert_eq!(tags, ["a", "b"]);

        // The relay's own names are left out in any case; it sets them.
        let headers = row_headers(br#"{"CE-Sequence": "9", "ce-id": "x", "x-tag": "y"}"#).unwrap();
        let names: Vec<String> = headers.iter().map(|(name, _)| name.to_string()).collect();
        assert_eq!(names, ["x-tag"]);

        let err = row_headers(br#"{"x-n": 1}"#).unwrap_err();
        assert_eq!(
            err,
            "headers column: key \"x-n\": expected a string or an array of strings, found 1"
        );
        for value in [r"a\nb", r"a\rb", r"a\u0001b", r"\u007f"] {
            let column = format!(r#"{{"x": "{value}"}}"#);
            let err = row_headers(column.as_bytes()).unwrap_err();
            assert!(
                err.contains("contains a control character"),
                "{column}: {err}"
            );
        }
        let headers = row_headers("{\"x\": \"a\\tb h\u{e9}llo\"}".as_bytes()).unwrap();
        assert_eq!(headers.get("x").unwrap().as_str(), "a\tb h\u{e9}llo");

        // A name is an HTTP token: not empty, and of tchar only.
        for name in [
            "bad name", "", "a(b", "x/y", "a@b", "q\\\"", "{}", "k=v", "a;b",
        ] {
            let column = serde_json::json!({ name: "v" }).to_string();
            let err = row_headers(column.as_bytes()).unwrap_err();
            assert!(
                err.starts_with(&format!("headers column: key {name:?}: a header name is")),
                "{column}: {err}"
            );
        }
        let column = br#"{"x.tag_1": "v", "A!#$%&'*+-^`|~z": "w"}"#;
        assert_eq!(row_headers(column).unwrap().len(), 2);
    }
}
