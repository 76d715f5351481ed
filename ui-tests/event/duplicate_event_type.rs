use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    Placed { customer: String },
    #[event(name = "Placed")]
    PlacedAgain { customer: String },
    // The same name at another version is fine.
    #[event(name = "Placed", version = 2)]
    PlacedV2 { customer: String, channel: String },
}

fn main() {}
