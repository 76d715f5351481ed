use outbox_runtime::{DomainEvent, PendingEvents, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed,
}

#[aggregate]
struct Order {
    #[aggregate_id]
    order_number: String,
    #[aggregate_id]
    tenant: String,
    pending_events: PendingEvents<OrderEvent>,
}

fn main() {}
