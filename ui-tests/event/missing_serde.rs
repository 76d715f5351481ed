use outbox_runtime::DomainEvent;

#[derive(DomainEvent)]
struct OrderPlaced {
    customer: String,
}

fn main() {}
