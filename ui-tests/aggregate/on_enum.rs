use outbox_runtime::{DomainEvent, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed,
}

#[aggregate]
enum Order {
    Draft { id: String },
}

fn main() {}
