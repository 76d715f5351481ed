//! A small domain for the tests: orders that record events.

use outbox_runtime::{DomainEvent, PendingEvents, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
pub enum OrderEvent {
    Placed {
        customer: String,
        total_cents: i64,
    },
    #[event(name = "LineAdded", version = 2)]
    ItemAdded {
        sku: String,
        quantity: u32,
    },
    Shipped,
}

#[aggregate]
#[derive(Debug)]
pub struct Order {
    pub id: String,
    pub status: String,
    pub pending_events: PendingEvents<OrderEvent>,
}

impl Order {
    pub fn place(id: &str, customer: &str, total_cents: i64) -> Self {
        let mut order = Order {
            id: id.to_owned(),
            status: "placed".to_owned(),
            pending_events: PendingEvents::new(),
        };
        order.record(OrderEvent::Placed {
            customer: customer.to_owned(),
            total_cents,
        });
        order
    }
}

/// An event partitioned by a field of its own rather than by the aggregate id.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(name = "PaymentCaptured")]
pub struct PaymentCaptured {
    #[event(partition_key)]
    pub merchant: String,
    pub amount_cents: i64,
}
