use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum OrderEvent {
    #[serde(rename = "order.placed")]
    Placed { customer: String },
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[serde(rename_all = "lowercase")]
enum Duplicates {
    Shipped,
    #[serde(rename = "shipped")]
    ShippedAgain,
}

fn main() {}
