use outbox_runtime::DomainEvent;

#[derive(DomainEvent)]
enum OrderEvent {
    Placed { customer: String },
}

fn main() {}
