use outbox_runtime::{DomainEvent, EventSet};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum AccountEvent {
    Opened { owner: String },
}

#[derive(EventSet)]
struct BankEvent {
    account: AccountEvent,
}

fn main() {}
