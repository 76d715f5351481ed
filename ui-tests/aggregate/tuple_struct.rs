use outbox_runtime::{DomainEvent, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed,
}

#[aggregate]
struct Order(#[aggregate_id] String);

fn main() {}
