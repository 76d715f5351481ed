use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn same(v: Value) -> Result<Value, String> {
    Ok(v)
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 4, upcast(from = 1, json = same), upcast(from = 3, json = same))]
struct PriceChanged {
    cents: i64,
}

fn main() {}
