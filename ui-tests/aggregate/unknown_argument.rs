use outbox_runtime::{DomainEvent, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed,
}

#[aggregate(event = OrderEvent, id = "number")]
struct Order {
    id: String,
}

fn main() {}
