//! OpenTelemetry traces across the broker (feature `opentelemetry`), through
//! `tracing-opentelemetry`: with its layer installed, one trace runs from the span that
//! committed a unit of work, through the relay's publish, into the handler and the events it
//! emits, with no code from the user.
//!
//! - A unit of work takes the trace context of the current `tracing` span (W3C
//!   `traceparent` and `tracestate`) into its rows' headers.
//! - The relay records a *producer* span per publish, a child of the row's context, and the
//!   message carries that span's context.
//! - The inbox runs each message's handler in a *consumer* span, a child of the message's
//!   context; the handler's unit of work takes the consumer span's context.
//!
//! Spans follow the OpenTelemetry semantic conventions for messaging spans (v1.27): named
//! `{operation} {destination template}` (`publish events.Order.*.Placed`, the partition-key
//! token of the subject as `*`, so names stay few), kind `producer` or `consumer`, and the
//! attributes `messaging.system` (`nats`), `messaging.operation.type` (`send`, `process`),
//! `messaging.operation.name`, `messaging.destination.name` (the subject),
//! `messaging.destination.template`, `messaging.message.id` (`ce-id`),
//! `messaging.message.body.size` and, for a consumer, `messaging.consumer.group.name`. The
//! spans are at INFO level, target `outbox_runtime::telemetry`. Without an OpenTelemetry
//! layer they record nothing, and no trace context is invented.

use async_nats::HeaderMap;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::causality::Traceparent;
#[cfg(feature = "postgres")]
use crate::inbox::Metadata;

/// The trace context of the current `tracing` span, when an OpenTelemetry layer records it:
/// its `traceparent`, and its `tracestate` unless empty.
pub(crate) fn current_context() -> Option<(Traceparent, Option<String>)> {
    context_of(&tracing::Span::current())
}

fn context_of(span: &tracing::Span) -> Option<(Traceparent, Option<String>)> {
    let context = span.context();
    let span_context = context.span().span_context().clone();
    if !span_context.is_valid() {
        return None;
    }
    let traceparent = Traceparent::from_parts(
        u128::from_be_bytes(span_context.trace_id().to_bytes()),
        u64::from_be_bytes(span_context.span_id().to_bytes()),
        span_context.trace_flags().to_u8(),
    )?;
    let tracestate = span_context.trace_state().header();
    Some((traceparent, (!tracestate.is_empty()).then_some(tracestate)))
}

/// The remote parent a message's `traceparent` and `tracestate` headers name.
fn remote_parent(headers: &HeaderMap) -> Option<opentelemetry::Context> {
    let traceparent: Traceparent = headers.get("traceparent")?.as_str().parse().ok()?;
    let (trace_id, parent_id, flags) = traceparent.parts();
    let tracestate = headers
        .get("tracestate")
        .and_then(|value| value.as_str().parse::<TraceState>().ok())
        .unwrap_or_default();
    let span_context = SpanContext::new(
        TraceId::from_bytes(trace_id.to_be_bytes()),
        SpanId::from_bytes(parent_id.to_be_bytes()),
        TraceFlags::new(flags),
        true,
        tracestate,
    );
    Some(opentelemetry::Context::new().with_remote_span_context(span_context))
}

/// The subject with its partition-key token (the second to last) as `*`: a destination name
/// of low cardinality, for span names.
fn template(subject: &str) -> String {
    let tokens: Vec<&str> = subject.split('.').collect();
    match tokens.len() {
        0..=2 => subject.to_owned(),
        n => {
            let mut tokens = tokens;
            tokens[n - 2] = "*";
            tokens.join(".")
        }
    }
}

/// The producer span of one publish, a child of the context `headers` carry (the row's),
/// with the message's `traceparent` and `tracestate` set to its own context. Costs one
/// disabled-callsite check when no subscriber takes the span.
pub(crate) fn producer_span(
    subject: &str,
    message_id: &str,
    body_size: usize,
    headers: &mut HeaderMap,
) -> tracing::Span {
    let span = tracing::info_span!(
        target: "outbox_runtime::telemetry",
        "publish",
        otel.name = tracing::field::Empty,
        otel.kind = "producer",
        "messaging.system" = "nats",
        "messaging.operation.type" = "send",
        "messaging.operation.name" = "publish",
        "messaging.destination.name" = %subject,
        "messaging.destination.template" = tracing::field::Empty,
        "messaging.message.id" = %message_id,
        "messaging.message.body.size" = body_size,
    );
    if span.is_disabled() {
        return span;
    }
    let destination = template(subject);
    span.record("otel.name", format_args!("publish {destination}"));
    span.record("messaging.destination.template", destination.as_str());
    if let Some(parent) = remote_parent(headers) {
        let _ = span.set_parent(parent);
    }
    if let Some((traceparent, tracestate)) = context_of(&span) {
        headers.insert("traceparent", traceparent.to_string());
        // A child inherits its parent's tracestate, so a row's own is never dropped here.
        if let Some(tracestate) = tracestate {
            headers.insert("tracestate", tracestate);
        }
    }
    span
}

/// The consumer span a message's handler runs in, a child of the context the message
/// carries; it also names the message's event type and deliveries, as the inbox's own span
/// does without this feature.
#[cfg(feature = "postgres")]
pub(crate) fn consumer_span(
    consumer: &str,
    metadata: &Metadata,
    message: &async_nats::jetstream::Message,
) -> tracing::Span {
    let span = tracing::info_span!(
        target: "outbox_runtime::telemetry",
        "process",
        otel.name = tracing::field::Empty,
        otel.kind = "consumer",
        "messaging.system" = "nats",
        "messaging.operation.type" = "process",
        "messaging.operation.name" = "process",
        "messaging.destination.name" = %metadata.subject,
        "messaging.destination.template" = tracing::field::Empty,
        "messaging.consumer.group.name" = %consumer,
        "messaging.message.id" = %metadata.id,
        "messaging.message.body.size" = message.payload.len(),
        event_type = %metadata.event_type,
        deliveries = metadata.deliveries,
    );
    if span.is_disabled() {
        return span;
    }
    let destination = template(&metadata.subject);
    span.record("otel.name", format_args!("process {destination}"));
    span.record("messaging.destination.template", destination.as_str());
    if let Some(parent) = message.headers.as_ref().and_then(remote_parent) {
        let _ = span.set_parent(parent);
    }
    span
}

#[cfg(test)]
mod tests {
    use super::template;

    #[test]
    fn the_template_hides_the_partition_key() {
        assert_eq!(
            template("events.Order.o-17.Placed"),
            "events.Order.*.Placed"
        );
        assert_eq!(
            template("a.b.shop.Order.o-17.Placed"),
            "a.b.shop.Order.*.Placed"
        );
        assert_eq!(template("x.y"), "x.y");
    }
}
