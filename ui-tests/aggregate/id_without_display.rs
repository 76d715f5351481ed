use outbox_runtime::{DomainEvent, PendingEvents, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum CartEvent {
    Opened,
}

#[aggregate]
struct Cart {
    id: Option<u64>,
    pending_events: PendingEvents<CartEvent>,
}

fn main() {}
