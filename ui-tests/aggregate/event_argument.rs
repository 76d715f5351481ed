use outbox_runtime::{DomainEvent, PendingEvents, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed,
}

#[aggregate(event = OrderEvent)]
struct Order {
    id: String,
    pending_events: PendingEvents<OrderEvent>,
}

fn main() {}
