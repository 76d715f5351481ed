use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
#[event(dedup_key)]
struct UserCreated {
    #[event(dedup_key)]
    request: String,
    #[event(dedup_key)]
    retry: String,
}

fn main() {}
