use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn same(v: Value) -> Result<Value, String> {
    Ok(v)
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 2, upcast(from = 2, json = same))]
struct PriceChanged {
    cents: i64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(upcast(from = 0, json = same))]
struct PriceDropped {
    cents: i64,
}

fn main() {}
