//! OpenTelemetry (feature `opentelemetry`), end to end against the real PostgreSQL and NATS,
//! with an in-memory exporter behind tracing-opentelemetry's layer: one trace runs from the
//! span that committed, through the relay's publish, into the handler, and on through the
//! event the handler emitted and its own publish.
//!
//! One test in this binary: tracing caches each callsite's interest across threads, and a
//! test without a subscriber running beside it could leave the relay's spans disabled.

mod support;

use std::time::Duration;

use opentelemetry::trace::{SpanId, SpanKind, TraceId, TracerProvider as _};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_runtime::{DomainEvent, Handler, Inbox, Metadata, Relay, UnitOfWork, UnitOfWorkError};
use serde::{Deserialize, Serialize};
use support::TestEnv;
use support::consumer::{consumer_config, consumer_database};
use support::domain::{Order, OrderEvent};
use tracing::Instrument as _;
use tracing_subscriber::layer::SubscriberExt as _;

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
struct ShipmentRequested {
    order: String,
}

/// Emits a `ShipmentRequested` for each order placed.
struct Shipping;

impl Handler for Shipping {
    type Event = OrderEvent;
    type Error = std::convert::Infallible;

    async fn handle(
        &self,
        _event: OrderEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        let requested = ShipmentRequested {
            order: message.aggregate_id.clone(),
        };
        uow.emit("Shipment", &message.aggregate_id, &requested);
        Ok(())
    }
}

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|KeyValue { key: k, .. }| k.as_str() == key)
        .map(|kv| &kv.value)
}

/// The one finished span named `name`.
fn span<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    let found: Vec<&SpanData> = spans.iter().filter(|s| s.name == name).collect();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
    assert_eq!(found.len(), 1, "one span {name:?} among {names:?}");
    found[0]
}

// One thread: the thread-local subscriber sees the relays' and the inbox's tasks.
#[tokio::test(flavor = "current_thread")]
async fn one_trace_runs_from_the_committing_span_through_the_relay_into_the_handler_and_on() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-test")));
    let _default = tracing::subscriber::set_default(subscriber);

    let producer = TestEnv::new().await;
    let consumer = consumer_database().await;

    // An HTTP-like request span commits an order.
    let request = tracing::info_span!("POST /orders", otel.kind = "server");
    let mut order = Order::place("o-1", "ada", 990);
    producer
        .outbox()
        .transaction(&mut producer.conn().await, async |uow| {
            uow.track(&mut order);
            Ok::<_, UnitOfWorkError>(())
        })
        .instrument(request)
        .await
        .unwrap();

    let relays = [
        Relay::connect(producer.relay_config(), producer.nats.clone())
            .await
            .unwrap()
            .spawn(),
        Relay::connect(consumer.relay_config(), consumer.nats.clone())
            .await
            .unwrap()
            .spawn(),
    ];
    let inbox = Inbox::connect(
        consumer_config(&consumer, &producer, "shipping"),
        producer.nats.clone(),
        Shipping,
    )
    .await
    .unwrap()
    .spawn();
    let requested = ShipmentRequested {
        order: "o-1".to_owned(),
    };
    consumer
        .wait_for_events(&[requested], Duration::from_secs(20))
        .await;
    inbox.shutdown().await.unwrap();
    for relay in relays {
        relay.shutdown().await.unwrap();
    }
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();

    let root = span(&spans, "POST /orders");
    let placed = span(
        &spans,
        &format!("publish {}.Order.*.Placed", producer.prefix),
    );
    let process = span(
        &spans,
        &format!("process {}.Order.*.Placed", producer.prefix),
    );
    let shipment = format!("publish {}.Shipment.*.ShipmentRequested", consumer.prefix);
    let emitted = span(&spans, &shipment);

    // One trace, each span the child of the one before.
    let trace: TraceId = root.span_context.trace_id();
    for span in [placed, process, emitted] {
        assert_eq!(
            span.span_context.trace_id(),
            trace,
            "{} in the trace",
            span.name
        );
    }
    assert_eq!(root.parent_span_id, SpanId::INVALID);
    assert_eq!(placed.parent_span_id, root.span_context.span_id());
    assert_eq!(process.parent_span_id, placed.span_context.span_id());
    assert!(
        process.parent_span_is_remote,
        "the consumer continues the message's context"
    );
    assert_eq!(emitted.parent_span_id, process.span_context.span_id());

    // The messaging conventions.
    assert_eq!(placed.span_kind, SpanKind::Producer);
    assert_eq!(process.span_kind, SpanKind::Consumer);
    assert_eq!(
        attribute(placed, "messaging.system"),
        Some(&Value::from("nats"))
    );
    assert_eq!(
        attribute(placed, "messaging.operation.type"),
        Some(&Value::from("send"))
    );
    assert_eq!(
        attribute(process, "messaging.operation.type"),
        Some(&Value::from("process"))
    );
    let subject = format!("{}.Order.o-1.Placed", producer.prefix);
    assert_eq!(
        attribute(placed, "messaging.destination.name"),
        Some(&Value::from(subject.clone()))
    );
    assert_eq!(
        attribute(process, "messaging.destination.name"),
        Some(&Value::from(subject))
    );
    assert_eq!(
        attribute(process, "messaging.consumer.group.name"),
        Some(&Value::from("shipping"))
    );
    assert_eq!(
        attribute(placed, "messaging.message.id"),
        attribute(process, "messaging.message.id"),
        "both name the message by its ce-id"
    );

    // The messages carry the producer spans' contexts.
    let on_stream = producer.stream_messages().await;
    let traceparent = on_stream[0].header("traceparent");
    assert_eq!(
        traceparent,
        format!(
            "00-{}-{}-01",
            placed.span_context.trace_id(),
            placed.span_context.span_id()
        )
    );
}
