use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn same(v: Value) -> Result<Value, String> {
    Ok(v)
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 2)]
#[event(upcast(from = 1, json = same))]
#[event(upcast(from = 1, json = same))]
struct PriceChanged {
    cents: i64,
}

fn main() {}
