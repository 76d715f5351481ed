use outbox_runtime::{DomainEvent, EventSet};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum AccountEvent {
    Opened { owner: String },
}

#[derive(EventSet)]
enum BankEvent {
    Account(AccountEvent),
    Closed { id: String },
    Frozen,
}

fn main() {}
