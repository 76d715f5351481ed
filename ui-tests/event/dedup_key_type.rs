use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
struct UserCreated {
    #[event(dedup_key)]
    request: u64,
}

fn main() {}
