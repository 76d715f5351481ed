use outbox_runtime::{DomainEvent, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum CartEvent {
    Opened,
}

#[aggregate(event = CartEvent)]
struct Cart {
    id: Option<u64>,
}

fn main() {}
