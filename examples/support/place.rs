//! Where a benchmark runs: a database of its own (migrated) and a stream of its own,
//! removed at the end. Shared by the benchmark examples through `#[path]`.
//!
//! `OUTBOX_BENCH_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`, a
//! server where it may create databases) and `NATS_URL` (default `nats://127.0.0.1:4222`)
//! point it elsewhere.

use async_nats::jetstream;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use outbox_runtime::{RelayConfig, StreamSettings, Topology};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A database and a stream for one run, named `outbox_{kind}_{tag}` and `{KIND}_{TAG}`,
/// the stream capturing `{kind}{tag}.>`.
pub struct Place {
    pub admin_url: String,
    pub database: String,
    pub database_url: String,
    pub nats: async_nats::Client,
    /// Where `nats` is connected, for a benchmark that opens clients of its own.
    #[allow(dead_code)] // not every benchmark does
    pub nats_url: String,
    pub prefix: String,
    pub stream: String,
}

impl Place {
    pub async fn new(kind: &str) -> Result<Self, BoxError> {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let admin_url = std::env::var("OUTBOX_BENCH_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let nats_url =
            std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let database = format!("outbox_{kind}_{tag}");
        AsyncPgConnection::establish(&admin_url)
            .await?
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .await?;
        let (server, _) = admin_url.rsplit_once('/').ok_or("no database in the URL")?;
        let database_url = format!("{server}/{database}");
        outbox_runtime::run_migrations(&database_url).await?;
        let nats = outbox_runtime::nats::connect(&nats_url).await?;
        let prefix = format!("{kind}{tag}");
        let stream = format!("{}_{}", kind.to_uppercase(), tag.to_uppercase());
        jetstream::new(nats.clone())
            .create_stream(jetstream::stream::Config {
                name: stream.clone(),
                subjects: vec![format!("{prefix}.>")],
                ..Default::default()
            })
            .await?;
        Ok(Self {
            admin_url,
            database,
            database_url,
            nats,
            nats_url,
            prefix,
            stream,
        })
    }

    /// A new connection to the run's database.
    #[allow(dead_code)] // not every benchmark opens its own
    pub async fn conn(&self) -> Result<AsyncPgConnection, BoxError> {
        Ok(AsyncPgConnection::establish(&self.database_url).await?)
    }

    /// The run's prefix and (existing) stream.
    pub fn topology(&self) -> Topology {
        Topology::new(
            self.prefix.parse().expect("a valid prefix"),
            StreamSettings {
                name: self.stream.clone(),
                create: false,
                ..StreamSettings::default()
            },
        )
    }

    /// A relay configuration for the run's database, prefix and (existing) stream.
    pub fn relay_config(&self) -> RelayConfig {
        let mut config = RelayConfig::new(&self.database_url);
        config.topology = self.topology();
        config.source = "/bench".to_owned();
        config
    }

    /// Deletes the stream and drops the database, whatever state the run left them in.
    pub async fn clean_up(&self) {
        let _ = jetstream::new(self.nats.clone())
            .delete_stream(&self.stream)
            .await;
        if let Ok(mut admin) = AsyncPgConnection::establish(&self.admin_url).await {
            let _ = admin
                .batch_execute(&format!(
                    "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                    self.database
                ))
                .await;
        }
    }
}

/// A JSON object payload of `bytes` bytes: `{"data":"xxx…"}`.
pub fn payload(bytes: usize) -> String {
    let filler = bytes.saturating_sub(r#"{"data":""}"#.len());
    format!(r#"{{"data":"{}"}}"#, "x".repeat(filler))
}
