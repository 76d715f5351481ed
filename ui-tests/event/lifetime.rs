use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
struct OrderPlaced<'a> {
    customer: &'a str,
}

fn main() {}
