use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Deserialize)]
struct PriceChangedV1 {
    price: f64,
}

fn same(v: Value) -> Result<Value, String> {
    Ok(v)
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 3, upcast(from = 1, type = PriceChangedV1), upcast(from = 2, json = same))]
struct PriceChanged {
    cents: i64,
}

fn main() {}
