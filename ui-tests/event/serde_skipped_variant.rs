use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed { customer: String },
    #[serde(skip)]
    Internal,
}

fn main() {}
