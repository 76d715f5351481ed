use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(nmae = "Placed")]
struct OrderPlaced {
    #[event(partition)]
    customer: String,
}

fn main() {}
