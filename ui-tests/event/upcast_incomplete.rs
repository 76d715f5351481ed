use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn same(v: Value) -> Result<Value, String> {
    Ok(v)
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 3, upcast(json = same), upcast(from = 2))]
struct PriceChanged {
    cents: i64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 2, upcast(from = 1, json = same, type = PriceDropped))]
struct PriceDropped {
    cents: i64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(version = 2, upcast(from = 1, with = same))]
struct PriceRaised {
    cents: i64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
struct PriceKept {
    #[event(upcast(from = 1, json = same))]
    cents: i64,
}

fn main() {}
