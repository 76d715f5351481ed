use outbox_runtime::DomainEvent;

#[derive(DomainEvent)]
union Raw {
    int: u32,
    float: f32,
}

fn main() {}
