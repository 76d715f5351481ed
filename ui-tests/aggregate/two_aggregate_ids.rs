use outbox_runtime::{DomainEvent, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed,
}

#[aggregate(event = OrderEvent)]
struct Order {
    #[aggregate_id]
    order_number: String,
    #[aggregate_id]
    tenant: String,
}

fn main() {}
