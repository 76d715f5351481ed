use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 2)]
enum OrderEvent {
    Placed { customer: String },
}

fn main() {}
