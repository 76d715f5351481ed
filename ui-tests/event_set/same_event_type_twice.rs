use outbox_runtime::{DomainEvent, EventSet};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
enum AccountEvent {
    Opened { owner: String },
}

#[derive(Serialize, Deserialize, DomainEvent)]
enum TransferEvent {
    Requested { cents: i64 },
    #[event(name = "Opened")]
    Started,
}

#[derive(EventSet)]
enum BankEvent {
    Account(AccountEvent),
    Transfer(TransferEvent),
}

fn main() {}
