use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct PriceChangedV1 {
    price: f64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 2, upcast(from = 1, type = PriceChangedV1))]
struct PriceChanged {
    cents: i64,
}

fn main() {}
