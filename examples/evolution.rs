//! An event type that changes while its old events live on: version 1 is published, the
//! code moves to version 2 with an upcast, and one consumer reads both as version 2.
//!
//! Version 1 of `Registered` carried `{"name": "Ada Lovelace"}`. Version 2 splits the name
//! (`given_name`, `family_name`); the version 1 type is gone from the code, and
//! `#[event(upcast(from = 1, json = split_name))]` says how its JSON becomes version 2's. The
//! example commits two customers with the version 1 code (module `v1`, as the service
//! deployed last year), two with the version 2 code, and runs an inbox with the version 2
//! handler: it prints each event with the version that arrived (`Metadata::event_version`).
//!
//! ```sh
//! cargo run --example evolution
//! ```
//!
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and `NATS_URL`
//! (default `nats://127.0.0.1:4222`) as in the quickstart.

use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection};
use outbox_runtime::{
    Handler, Inbox, InboxConfig, Metadata, Outbox, Relay, RelayConfig, StreamSettings, Topology,
    UnitOfWork, UnitOfWorkError,
};
use tokio::sync::mpsc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service as it was deployed with version 1 of the event.
mod v1 {
    use outbox_runtime::{DomainEvent, PendingEvents, aggregate};
    use serde::{Deserialize, Serialize};

    #[derive(Debug, Serialize, Deserialize, DomainEvent)]
    pub enum CustomerEvent {
        Registered { name: String },
    }

    #[aggregate]
    pub struct Customer {
        pub id: String,
        pub pending_events: PendingEvents<CustomerEvent>,
    }
}

/// The service today: `Registered` is at version 2 and still reads version 1.
mod v2 {
    use outbox_runtime::{DomainEvent, PendingEvents, UpcastError, aggregate};
    use serde::{Deserialize, Serialize};
    use serde_json::{Value, json};

    #[derive(Debug, Serialize, Deserialize, DomainEvent)]
    pub enum CustomerEvent {
        #[event(version = 2, upcast(from = 1, json = split_name))]
        Registered {
            given_name: String,
            family_name: String,
        },
    }

    /// Version 1's `{"name": "Ada Lovelace"}` as version 2's
    /// `{"given_name": "Ada", "family_name": "Lovelace"}`.
    fn split_name(v1: Value) -> Result<Value, UpcastError> {
        let name = v1["name"]
            .as_str()
            .ok_or("a version 1 payload has a name")?;
        let (given, family) = name.split_once(' ').unwrap_or((name, ""));
        Ok(json!({ "given_name": given, "family_name": family }))
    }

    #[aggregate]
    pub struct Customer {
        pub id: String,
        pub pending_events: PendingEvents<CustomerEvent>,
    }
}

/// The consumer, written against version 2 only.
struct Welcome {
    run: String,
    seen: mpsc::UnboundedSender<(String, i32, v2::CustomerEvent)>,
}

impl Handler for Welcome {
    type Event = v2::CustomerEvent;
    type Error = std::convert::Infallible;

    async fn handle(
        &self,
        event: v2::CustomerEvent,
        message: &Metadata,
        _uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        // Earlier runs' customers were handled by earlier runs.
        if message.aggregate_id.starts_with(&self.run) {
            let _ = self
                .seen
                .send((message.aggregate_id.clone(), message.event_version, event));
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    outbox_runtime::run_migrations(&database_url).await?;
    let nats = outbox_runtime::nats::connect(&nats_url).await?;
    let stream = StreamSettings {
        name: "EVOLUTION".to_owned(),
        ..StreamSettings::default()
    };
    let topology = Topology::new("evolution".parse()?, stream);
    let outbox = Outbox::with_topology(topology.clone());
    let mut relay_config = RelayConfig::new(&database_url);
    relay_config.topology = topology.clone();
    let relay = Relay::connect(relay_config, nats.clone()).await?.spawn();

    let run = uuid::Uuid::now_v7().simple().to_string()[20..].to_owned();
    let mut conn = AsyncPgConnection::establish(&database_url).await?;

    // Last year's code: version 1.
    for (n, name) in ["Ada Lovelace", "Alan Turing"].into_iter().enumerate() {
        let mut customer = v1::Customer {
            id: format!("{run}-{n}"),
            pending_events: Default::default(),
        };
        customer.record(v1::CustomerEvent::Registered { name: name.into() });
        outbox
            .transaction(&mut conn, async |uow| {
                uow.track(&mut customer);
                Ok::<_, UnitOfWorkError>(())
            })
            .await?;
        println!("v1 code: registered {} ({name})", customer.id);
    }
    // Today's code: version 2.
    for (n, (given, family)) in [("Grace", "Hopper"), ("Edsger", "Dijkstra")]
        .into_iter()
        .enumerate()
    {
        let mut customer = v2::Customer {
            id: format!("{run}-{}", n + 2),
            pending_events: Default::default(),
        };
        customer.record(v2::CustomerEvent::Registered {
            given_name: given.into(),
            family_name: family.into(),
        });
        outbox
            .transaction(&mut conn, async |uow| {
                uow.track(&mut customer);
                Ok::<_, UnitOfWorkError>(())
            })
            .await?;
        println!("v2 code: registered {} ({given} {family})", customer.id);
    }

    // One consumer, version 2's code, reads all four.
    let (seen, mut received) = mpsc::unbounded_channel();
    let mut config = InboxConfig::new("evolution-welcome", &database_url);
    config.topology = topology;
    config.outbox = outbox;
    config.filter_subjects = vec!["evolution.Customer.*.Registered".to_owned()];
    let handler = Welcome {
        run: run.clone(),
        seen,
    };
    let inbox = Inbox::connect(config, nats, handler).await?.spawn();
    let mut versions = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        while versions.len() < 4 {
            let Some((id, version, event)) = received.recv().await else {
                break;
            };
            let v2::CustomerEvent::Registered {
                given_name,
                family_name,
            } = event;
            println!(
                "consumer: {id} arrived as version {version}, read as version 2: \
                 given_name {given_name:?}, family_name {family_name:?}"
            );
            versions.push(version);
        }
    })
    .await;
    inbox.shutdown().await?;
    relay.shutdown().await?;
    if read.is_err() {
        return Err(format!(
            "only {} of 4 customers reached the consumer in 30 s",
            versions.len()
        )
        .into());
    }
    versions.sort_unstable();
    if versions != [1, 1, 2, 2] {
        return Err(format!("unexpected versions: {versions:?}").into());
    }
    println!("two version 1 and two version 2 events, all read as version 2");
    Ok(())
}
