use outbox_runtime::{DomainEvent, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed,
}

#[aggregate(name = "sales.Order", event = OrderEvent)]
struct Order {
    id: String,
}

fn main() {}
