use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(partition_key)]
struct OrderPlaced {
    #[event(name = "customer")]
    customer: String,
}

fn main() {}
