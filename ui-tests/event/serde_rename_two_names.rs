use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    #[serde(rename(serialize = "placed", deserialize = "order-placed"))]
    Placed { customer: String },
}

fn main() {}
