use outbox_runtime::DomainEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, DomainEvent)]
struct PaymentCaptured {
    #[event(partition_key)]
    merchant: String,
    #[event(partition_key)]
    customer: String,
}

fn main() {}
