use outbox_runtime::{DomainEvent, PendingEvents, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed,
}

#[aggregate]
#[derive(diesel::Queryable)]
struct Order {
    id: String,
    pending_events: PendingEvents<OrderEvent>,
}

fn main() {}
