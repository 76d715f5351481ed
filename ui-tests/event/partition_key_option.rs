use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
struct PaymentCaptured {
    #[event(partition_key)]
    merchant: Option<String>,
    amount_cents: i64,
}

#[derive(Serialize, Deserialize, DomainEvent)]
enum PaymentEvent {
    Refunded {
        #[event(partition_key)]
        merchant: Vec<u8>,
    },
}

fn main() {}
