use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[serde(tag = "type")]
enum OrderEvent {
    Placed { customer: String },
}

fn main() {}
