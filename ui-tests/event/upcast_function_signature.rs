use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn to_v2(v: &Value) -> Value {
    v.clone()
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 2, upcast(from = 1, json = to_v2))]
struct PriceChanged {
    cents: i64,
}

fn main() {}
