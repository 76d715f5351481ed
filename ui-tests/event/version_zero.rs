use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 0)]
struct OrderPlaced {
    customer: String,
}

fn main() {}
