//! A bank service as a newcomer writes it, with `outbox-runtime`, `serde` and `tokio` as its
//! only dependencies: accounts are opened and money moves between two of them in units of
//! work (one of which fails and rolls back), the relay publishes the events, and an inbox
//! builds a read model of balances and transfers from them, the accounts' events and the
//! transfers' through one durable consumer.
//!
//! ```sh
//! cargo run -p outbox-standalone-example
//! ```
//!
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and `NATS_URL` (default
//! `nats://127.0.0.1:4222`) point it elsewhere.

use std::time::Duration;

use outbox_runtime::diesel::prelude::*;
use outbox_runtime::diesel::sql_types::{BigInt, Text};
use outbox_runtime::diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use outbox_runtime::{
    DomainEvent, EventSet, Handler, Inbox, InboxConfig, Metadata, Outbox, PendingEvents, Relay,
    RelayConfig, StreamSettings, Topology, UnitOfWork, UnitOfWorkError, aggregate, diesel,
    diesel_async,
};
use serde::{Deserialize, Serialize};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Serialize, Deserialize, DomainEvent)]
enum AccountEvent {
    Opened { owner: String },
    Credited { cents: i64 },
    Debited { cents: i64 },
}

/// What the transfer itself records: emitted by the unit of work that moves the money.
#[derive(Debug, Serialize, Deserialize, DomainEvent)]
#[event(name = "TransferCompleted")]
struct TransferCompleted {
    from: String,
    to: String,
    cents: i64,
}

/// Everything the read model consumes, through one durable consumer: the accounts' events
/// and the transfers'.
#[derive(Debug, EventSet)]
enum BankEvent {
    Account(AccountEvent),
    Transfer(TransferCompleted),
}

#[aggregate]
struct Account {
    id: String,
    balance: i64,
    pending_events: PendingEvents<AccountEvent>,
}

impl Account {
    fn open(id: String, owner: &str) -> Self {
        let mut account = Account {
            id,
            balance: 0,
            pending_events: PendingEvents::new(),
        };
        account.record(AccountEvent::Opened {
            owner: owner.to_owned(),
        });
        account
    }

    fn credit(&mut self, cents: i64) {
        self.balance += cents;
        self.record(AccountEvent::Credited { cents });
    }

    fn debit(&mut self, cents: i64) -> Result<(), Overdrawn> {
        if cents > self.balance {
            return Err(Overdrawn(self.id.clone()));
        }
        self.balance -= cents;
        self.record(AccountEvent::Debited { cents });
        Ok(())
    }
}

#[derive(Debug)]
struct Overdrawn(String);

impl std::error::Error for Overdrawn {}

impl std::fmt::Display for Overdrawn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "account {} would be overdrawn", self.0)
    }
}

/// The service's own error: its rule, or the unit of work's.
#[derive(Debug)]
enum TransferError {
    Overdrawn(Overdrawn),
    UnitOfWork(UnitOfWorkError),
}

impl std::fmt::Display for TransferError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Overdrawn(error) => error.fmt(f),
            Self::UnitOfWork(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for TransferError {}

impl From<UnitOfWorkError> for TransferError {
    fn from(error: UnitOfWorkError) -> Self {
        Self::UnitOfWork(error)
    }
}

impl From<diesel::result::Error> for TransferError {
    fn from(error: diesel::result::Error) -> Self {
        Self::UnitOfWork(error.into())
    }
}

/// Saves the account's balance, the business row of each unit of work.
async fn save(conn: &mut AsyncPgConnection, account: &Account) -> diesel::QueryResult<usize> {
    diesel::sql_query(
        "INSERT INTO bank_accounts (id, balance) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance = excluded.balance",
    )
    .bind::<Text, _>(&account.id)
    .bind::<BigInt, _>(account.balance)
    .execute(conn)
    .await
}

/// Moves `cents` from one account to the other: both rows and all their events, or nothing.
/// The accounts are tracked first: what they record afterwards is part of the unit of work.
async fn transfer(
    outbox: &Outbox,
    conn: &mut AsyncPgConnection,
    from: &mut Account,
    to: &mut Account,
    cents: i64,
) -> Result<(), TransferError> {
    outbox
        .transaction(conn, async |uow| {
            uow.track(from);
            uow.track(to);
            from.debit(cents).map_err(TransferError::Overdrawn)?;
            to.credit(cents);
            save(uow.conn(), from).await?;
            save(uow.conn(), to).await?;
            let transfer = format!("{}-{}", from.id, to.id);
            let completed = TransferCompleted {
                from: from.id.clone(),
                to: to.id.clone(),
                cents,
            };
            uow.emit("Transfer", &transfer, &completed);
            Ok(())
        })
        .await
}

/// The read model: each account's balance and the transfers it took part in, as the events
/// tell them.
struct Balances;

impl Handler for Balances {
    type Event = BankEvent;
    type Error = diesel::result::Error;

    async fn handle(
        &self,
        event: BankEvent,
        message: &Metadata,
        uow: &mut UnitOfWork<'_>,
    ) -> Result<(), Self::Error> {
        let change = match event {
            BankEvent::Account(AccountEvent::Opened { .. }) => 0,
            BankEvent::Account(AccountEvent::Credited { cents }) => cents,
            BankEvent::Account(AccountEvent::Debited { cents }) => -cents,
            BankEvent::Transfer(TransferCompleted { from, to, .. }) => {
                // The transfer and the accounts' events are of different aggregates, applied
                // in no set order between them: an upsert that adds commutes with theirs.
                diesel::sql_query(
                    "INSERT INTO bank_balances (id, cents, transfers) VALUES ($1, 0, 1), ($2, 0, 1) \
                     ON CONFLICT (id) DO UPDATE SET transfers = bank_balances.transfers + 1",
                )
                .bind::<Text, _>(from)
                .bind::<Text, _>(to)
                .execute(uow.conn())
                .await?;
                return Ok(());
            }
        };
        let account = message.aggregate_id.as_str();
        diesel::sql_query(
            "INSERT INTO bank_balances (id, cents) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET cents = bank_balances.cents + excluded.cents",
        )
        .bind::<Text, _>(account)
        .bind::<BigInt, _>(change)
        .execute(uow.conn())
        .await?;
        Ok(())
    }
}

#[derive(QueryableByName)]
struct Balance {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = BigInt)]
    cents: i64,
    #[diesel(sql_type = BigInt)]
    transfers: i64,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());

    outbox_runtime::run_migrations(&database_url).await?;
    let mut conn = AsyncPgConnection::establish(&database_url).await?;
    diesel_async::SimpleAsyncConnection::batch_execute(
        &mut conn,
        "CREATE TABLE IF NOT EXISTS bank_accounts (id text PRIMARY KEY, balance bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS bank_balances (id text PRIMARY KEY, cents bigint NOT NULL);
         ALTER TABLE bank_balances ADD COLUMN IF NOT EXISTS transfers bigint NOT NULL DEFAULT 0;",
    )
    .await?;

    let nats = outbox_runtime::nats::connect(&nats_url).await?;
    // The bank's topology, configured once for its units of work, its relay and its inbox.
    let stream = StreamSettings {
        name: "BANK".to_owned(),
        ..StreamSettings::default()
    };
    let topology = Topology::new("bank".parse()?, stream);
    let outbox = Outbox::with_topology(topology.clone());
    let mut relay_config = RelayConfig::new(&database_url);
    relay_config.topology = topology.clone();
    let mut relay = Relay::connect(relay_config, nats.clone()).await?.spawn();
    let mut inbox_config = InboxConfig::new("bank-read-model", &database_url);
    inbox_config.topology = topology; // every subject of it: bank.>
    let mut inbox = Inbox::connect(inbox_config, nats, Balances).await?.spawn();

    // Two accounts, opened and funded in one unit of work.
    let run = outbox_runtime::uuid::Uuid::now_v7().simple().to_string();
    let run = &run[20..];
    let mut ada = Account::open(format!("ada-{run}"), "ada");
    let mut bob = Account::open(format!("bob-{run}"), "bob");
    ada.credit(10_000);
    outbox
        .transaction(&mut conn, async |uow| {
            save(uow.conn(), &ada).await?;
            save(uow.conn(), &bob).await?;
            uow.track(&mut ada);
            uow.track(&mut bob);
            Ok::<_, UnitOfWorkError>(())
        })
        .await?;
    println!("opened {} with 100.00 and {}", ada.id, bob.id);

    transfer(&outbox, &mut conn, &mut ada, &mut bob, 2_500)
        .await
        .map_err(|e| format!("{e:?}"))?;
    println!("moved 25.00 from {} to {}", ada.id, bob.id);
    match transfer(&outbox, &mut conn, &mut bob, &mut ada, 9_000).await {
        Err(TransferError::Overdrawn(error)) => println!("refused: {error}; nothing written"),
        other => return Err(format!("the overdraft went through: {other:?}").into()),
    }

    // The inbox builds the read model from the published events.
    let expected = [(ada.id.clone(), 7_500, 1), (bob.id.clone(), 2_500, 1)];
    // A service waits on its own work beside the relay's and the inbox's `stopped()`: each
    // ends only on a bug (a task's panic), and then the process should exit, for its
    // supervisor to start it again, rather than run on with nothing published or applied.
    let read_model = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let balances: Vec<Balance> = diesel::sql_query(
                "SELECT id, cents, transfers FROM bank_balances WHERE id = ANY($1) ORDER BY id",
            )
            .bind::<diesel::sql_types::Array<Text>, _>(vec![&ada.id, &bob.id])
            .load(&mut conn)
            .await?;
            let seen: Vec<(String, i64, i64)> = balances
                .into_iter()
                .map(|b| (b.id, b.cents, b.transfers))
                .collect();
            if seen == expected {
                return Ok::<_, BoxError>(seen);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let balances = tokio::select! {
        caught_up = read_model => {
            caught_up.map_err(|_| "the read model did not catch up in 30 s")??
        }
        stopped = relay.stopped() => {
            return Err(format!("the relay stopped: {stopped:?}").into());
        }
        stopped = inbox.stopped() => {
            return Err(format!("the inbox stopped: {stopped:?}").into());
        }
    };
    for (account, cents, transfers) in balances {
        println!(
            "read model: {account} holds {}.{:02}, {transfers} transfer",
            cents / 100,
            cents % 100
        );
    }

    inbox.shutdown().await?;
    relay.shutdown().await?;
    Ok(())
}
