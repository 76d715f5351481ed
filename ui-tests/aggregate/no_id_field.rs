use outbox_runtime::{DomainEvent, PendingEvents, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed,
}

#[aggregate]
struct Order {
    order_number: String,
    pending_events: PendingEvents<OrderEvent>,
}

fn main() {}
