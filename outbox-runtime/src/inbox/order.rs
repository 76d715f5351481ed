//! Per-aggregate order across restarts and instances: what a consumer does when an event
//! arrives and the one before it has not been applied.
//!
//! The consumer's position in each aggregate (`outbox_inbox_positions`) says which event it
//! applied last. An event that is not the next one either waits for its predecessor or is
//! applied over a gap, and the stream tells which: the relay publishes an aggregate's events
//! in `ce-sequence` order, each after the previous one's ack, so the predecessor of an event
//! is in the stream before it, or it never will be (skipped on the producer side, or removed
//! from the stream by its limits). [`predecessor`] looks for it between the message of the
//! last applied event and this one, on the subjects of the aggregate that the consumer's
//! filter takes (`STREAM.MSG.GET` with `next_by_subj`, nats-server 2.9 and later):
//! - found, and not applied: the event waits (in place, parked, or nak'd with a delay;
//!   counting no failure) until
//!   the predecessor is applied, or dead-lettered, which also moves the position. The
//!   predecessor is with another instance, or with one that died and whose messages JetStream
//!   delivers again after `ack_wait`.
//! - not found: nothing before it will come. The event is applied, and, when the consumer's
//!   filter takes every event type of the aggregate (so the missing events were the
//!   producer's to skip), the gap is recorded in `outbox_inbox_gaps` with a warning. First,
//!   the caller checks with [`holds`] that the last applied event's message is where the
//!   position recorded it: a stream deleted and created again numbers its messages from 1,
//!   below the sequences the positions recorded, and the search then starts from the
//!   consumer's ack floor instead.
//!
//! An event older than the position (a skipped dead letter that the producer retried later)
//! cannot be applied in order any more: it is dead-lettered by the consumer, for an operator.
//!
//! Limits: the lookup searches the subjects `{..}.{type}.{key}.*` of the event's own
//! partition key and, when it differs, of the aggregate id; an aggregate whose event types
//! use yet other partition keys can see an event applied over a predecessor that the lookup
//! did not find, and that predecessor is then dead-lettered as late (visible, never applied
//! out of order). A predecessor that does not settle within `gap_timeout` (a safety valve:
//! with the inbox's own redeliveries it always settles) is skipped over the same way.

use std::time::Duration;

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{RawMessageErrorKind, Stream};
use percent_encoding::percent_decode_str;

use super::message::Metadata;

/// What the stream holds before an event whose predecessor has not been applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Predecessor {
    /// An earlier event of the aggregate that the consumer takes, not applied yet: the
    /// caller checks whether it was settled otherwise (dead-lettered as unreadable), and
    /// looks again after it if so.
    Pending {
        /// Its `ce-sequence`.
        seq: i64,
        /// Its stream sequence.
        stream_sequence: u64,
        /// Its `ce-id` (else `Nats-Msg-Id`), as the inbox records it.
        id: Option<String>,
    },
    /// Nothing: the event is the next one the consumer will see. `filtered` when the
    /// consumer's filter leaves out some of the aggregate's subjects, so a gap is expected.
    Missing { filtered: bool },
    /// The stream could not be asked (unreachable, or too many other messages between): wait
    /// and ask again.
    Unknown(String),
}

/// How many messages of other aggregates on the same subjects one lookup reads before it
/// gives up for now (they share a partition key).
const MAX_SCANNED: usize = 256;

/// How long one JetStream request of the lookup (the consumer's ack floor, a message of the
/// stream) may go unanswered. A request sent to a server that dies with it, or while the
/// stream or the consumer elects a new leader, is never answered, and async-nats would wait
/// its own request timeout (10 s) while the event held a handler slot. Unanswered, the
/// event is held and asked about again later: "cannot tell" never applies it over a gap.
pub(super) const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// Looks in `stream` for the predecessor of `event` (at stream sequence
/// `metadata.stream_sequence`), given the consumer's `filters`, the last applied sequence
/// `last_seq` of its aggregate and that event's stream sequence `from`, and the consumer's
/// ack floor (every message at or below it is settled). Each request to the stream waits at
/// most [`LOOKUP_TIMEOUT`].
pub(super) async fn predecessor(
    stream: &Stream,
    filters: &[String],
    metadata: &Metadata,
    last_seq: i64,
    from: u64,
    ack_floor: u64,
) -> Predecessor {
    let Some((aggregate_type, aggregate_id, seq)) = metadata.place() else {
        return Predecessor::Missing { filtered: false };
    };
    let mut filtered = false;
    let mut scanned = 0;
    for pattern in aggregate_patterns(&metadata.subject, aggregate_type, aggregate_id) {
        // The aggregate's subjects the consumer takes: the whole pattern when one filter
        // covers it, else each part some filter takes.
        let mut parts: Vec<String> = filters
            .iter()
            .filter_map(|filter| intersect(filter, &pattern))
            .collect();
        if parts.contains(&pattern) {
            parts = vec![pattern.clone()];
        } else {
            filtered = true;
        }
        for wanted in parts {
            let mut next = from.max(ack_floor) + 1;
            while next < metadata.stream_sequence {
                if scanned == MAX_SCANNED {
                    return Predecessor::Unknown(format!(
                        "{MAX_SCANNED} messages of other aggregates on {pattern} lie between; \
                     asking again later"
                    ));
                }
                scanned += 1;
                let request = stream
                    .raw_message_builder()
                    .sequence(next)
                    .next_by_subject(wanted.clone())
                    .send();
                let found = match tokio::time::timeout(LOOKUP_TIMEOUT, request).await {
                    Err(_) => return Predecessor::Unknown("the stream did not answer".to_owned()),
                    Ok(Err(error)) if error.kind() == RawMessageErrorKind::NoMessageFound => break,
                    Ok(Err(error)) => return Predecessor::Unknown(error.to_string()),
                    Ok(Ok(found)) => found,
                };
                if found.sequence >= metadata.stream_sequence {
                    break;
                }
                if let Some(found_seq) = sequence_in_aggregate(&found, metadata)
                    && found_seq > last_seq
                    && found_seq < seq
                {
                    return Predecessor::Pending {
                        seq: found_seq,
                        stream_sequence: found.sequence,
                        id: header(&found, "ce-id").or_else(|| header(&found, "Nats-Msg-Id")),
                    };
                }
                next = found.sequence + 1;
            }
        }
    }
    Predecessor::Missing { filtered }
}

/// Whether `stream` holds at `stream_sequence` the event `last_seq` of the aggregate of
/// `metadata`'s event: where the consumer's position says it applied it. It does not when
/// the stream was created again since (its sequences started over) or its limits removed
/// the message. `Err` when the stream did not answer within [`LOOKUP_TIMEOUT`].
pub(super) async fn holds(
    stream: &Stream,
    metadata: &Metadata,
    last_seq: i64,
    stream_sequence: u64,
) -> Result<bool, String> {
    let request = stream
        .raw_message_builder()
        .sequence(stream_sequence)
        .send();
    match tokio::time::timeout(LOOKUP_TIMEOUT, request).await {
        Err(_) => Err("the stream did not answer".to_owned()),
        Ok(Err(error)) if error.kind() == RawMessageErrorKind::NoMessageFound => Ok(false),
        Ok(Err(error)) => Err(error.to_string()),
        Ok(Ok(found)) => Ok(sequence_in_aggregate(&found, metadata) == Some(last_seq)),
    }
}

/// The `ce-sequence` of the event `found` carries when it is of the same aggregate as
/// `metadata`'s event (same `ce-source`, `ce-aggregatetype` and `ce-subject`).
fn sequence_in_aggregate(found: &StreamMessage, metadata: &Metadata) -> Option<i64> {
    let (aggregate_type, aggregate_id, _) = metadata.place()?;
    let same_aggregate = header(found, "ce-source") == metadata.source
        && header(found, "ce-aggregatetype").as_deref() == Some(aggregate_type)
        && header(found, "ce-subject").as_deref() == Some(aggregate_id);
    same_aggregate
        .then(|| header(found, "ce-sequence")?.parse().ok())
        .flatten()
}

/// A header of a stream message, percent-decoded as the relay encodes it.
fn header(found: &StreamMessage, name: &str) -> Option<String> {
    found
        .headers
        .get(name)
        .and_then(|value| percent_decode_str(value.as_str()).decode_utf8().ok())
        .map(|value| value.into_owned())
}

/// The subject patterns an aggregate's events may be published on, from one event's
/// subject: the subject with its last token (the event type) a wildcard, and, when the
/// subject follows `{prefix}.{type}.{key}.{event}` with a partition key that is not the
/// aggregate id, the same with the aggregate id as the key.
fn aggregate_patterns(subject: &str, aggregate_type: &str, aggregate_id: &str) -> Vec<String> {
    let tokens: Vec<&str> = subject.split('.').collect();
    let Some((_, rest)) = tokens.split_last() else {
        return Vec::new();
    };
    let mut patterns = vec![format!("{}.*", rest.join("."))];
    if let [prefix @ .., type_token, key] = rest
        && !prefix.is_empty()
        && *type_token == aggregate_type
        && *key != aggregate_id
        && crate::subject::validate_token(aggregate_id).is_ok()
    {
        patterns.push(format!(
            "{}.{type_token}.{aggregate_id}.*",
            prefix.join(".")
        ));
    }
    patterns
}

/// The subjects matched by both `filter` and `pattern` (NATS subject filters, with `*` and
/// `>`), as one filter; `None` when none matches both.
fn intersect(filter: &str, pattern: &str) -> Option<String> {
    let a: Vec<&str> = filter.split('.').collect();
    let b: Vec<&str> = pattern.split('.').collect();
    let mut out: Vec<&str> = Vec::with_capacity(a.len().max(b.len()));
    let mut i = 0;
    loop {
        match (a.get(i), b.get(i)) {
            (None, None) => return Some(out.join(".")),
            (Some(&">"), Some(_)) => {
                out.extend(&b[i..]);
                return Some(out.join("."));
            }
            (Some(_), Some(&">")) => {
                out.extend(&a[i..]);
                return Some(out.join("."));
            }
            (Some(&x), Some(&y)) => {
                let token = match (x, y) {
                    ("*", other) | (other, "*") => other,
                    (x, y) if x == y => x,
                    _ => return None,
                };
                out.push(token);
            }
            _ => return None,
        }
        i += 1;
    }
}

/// Whether the subject filter `filter` matches every subject that `pattern` (a filter, or a
/// subject: the pattern of itself) matches: token by token, `filter` has `>` over the rest
/// (one token or more), `*` over one token other than `>`, or the same token.
pub(crate) fn covers(filter: &str, pattern: &str) -> bool {
    let mut pattern = pattern.split('.');
    for token in filter.split('.') {
        match (token, pattern.next()) {
            (">", Some(_)) => return true,
            ("*", Some(other)) if other != ">" => {}
            (token, Some(other)) if token == other => {}
            _ => return false,
        }
    }
    pattern.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_intersect_token_by_token() {
        let cases = [
            ("events.>", "events.Order.o-1.*", Some("events.Order.o-1.*")),
            (
                "events.Order.*.Placed",
                "events.Order.o-1.*",
                Some("events.Order.o-1.Placed"),
            ),
            (
                "events.*.o-1.>",
                "events.Order.o-1.*",
                Some("events.Order.o-1.*"),
            ),
            (">", "events.Order.o-1.*", Some("events.Order.o-1.*")),
            ("events.Invoice.>", "events.Order.o-1.*", None),
            ("events.Order.*", "events.Order.o-1.*", None),
            ("events.Order.o-1.Placed.x", "events.Order.o-1.*", None),
            (
                "events.*.*.*",
                "events.Order.o-1.*",
                Some("events.Order.o-1.*"),
            ),
        ];
        for (filter, pattern, expected) in cases {
            assert_eq!(
                intersect(filter, pattern).as_deref(),
                expected,
                "{filter} with {pattern}"
            );
        }
    }

    #[test]
    fn a_filter_covers_what_each_of_its_tokens_takes() {
        let cases = [
            ("events.>", "events.>", true),
            ("events.>", "events.Order.o-1.Placed", true),
            ("events.>", "events", false),
            (">", "events.>", true),
            ("events.*.>", "events.>", false),
            ("events.*", "events.Order", true),
            ("events.*", "events.*", true),
            ("events.*", "events.>", false),
            ("events.*", "events.Order.o-1", false),
            ("events.Order.>", "events.>", false),
            ("events.Order.>", "events.*.o-1.Placed", false),
            ("events.*.o-1.Placed", "events.Order.o-1.Placed", true),
            ("events.Order", "events.*", false),
            ("events.Order", "events.Order", true),
            ("events.Order", "events.Order.o-1", false),
            ("events", "other", false),
        ];
        for (filter, pattern, expected) in cases {
            assert_eq!(covers(filter, pattern), expected, "{filter} over {pattern}");
        }
    }

    #[test]
    fn an_aggregates_patterns_cover_its_key_and_its_id() {
        assert_eq!(
            aggregate_patterns("events.Order.o-1.Placed", "Order", "o-1"),
            ["events.Order.o-1.*"]
        );
        assert_eq!(
            aggregate_patterns("acme.orders.Order.ada.Placed", "Order", "o-1"),
            ["acme.orders.Order.ada.*", "acme.orders.Order.o-1.*"]
        );
        // A subject outside the scheme: only its own pattern.
        assert_eq!(aggregate_patterns("x.y", "Order", "o-1"), ["x.*"]);
        // An aggregate id that is no subject token cannot be a pattern.
        assert_eq!(
            aggregate_patterns("events.Order.k.Placed", "Order", "a b"),
            ["events.Order.k.*"]
        );
    }
}
