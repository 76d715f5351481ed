use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn same(v: Value) -> Result<Value, String> {
    Ok(v)
}

#[derive(Serialize, Deserialize, DomainEvent)]
enum PriceEvent {
    #[event(name = "Changed")]
    ChangedV1 { price: f64 },
    #[event(name = "Changed", version = 2, upcast(from = 1, json = same))]
    Changed { cents: i64 },
}

fn main() {}
