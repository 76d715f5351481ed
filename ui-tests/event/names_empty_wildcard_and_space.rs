use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

// Every bad name is reported at once, each on its own literal.
#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    #[event(name = "")]
    Placed { customer: String },
    #[event(name = "Shipped>")]
    Shipped,
    #[event(name = "Item Added")]
    ItemAdded { sku: String },
}

fn main() {}
