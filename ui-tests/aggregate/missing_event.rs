use outbox_runtime::aggregate;

#[aggregate(name = "Order")]
struct Order {
    id: String,
}

fn main() {}
