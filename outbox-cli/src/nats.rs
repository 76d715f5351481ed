//! The NATS flags every command that talks to NATS shares: the servers and one way to
//! authenticate (see `outbox_runtime::nats::NatsSettings`).

use std::path::PathBuf;

use clap::Args;
use outbox_runtime::nats::NatsSettings;

#[derive(Debug, Args, Clone)]
pub(crate) struct NatsArgs {
    /// The NATS server, or several separated by commas. Credentials in the URL
    /// (`nats://user:password@host`, `nats://token@host`) are used and never logged.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true,
        hide_default_value = true
    )]
    nats_url: String,
    /// A user, with --nats-password.
    #[arg(long, env = "NATS_USER")]
    nats_user: Option<String>,
    /// The user's password.
    #[arg(long, env = "NATS_PASSWORD", hide_env_values = true)]
    nats_password: Option<String>,
    /// A token.
    #[arg(long, env = "NATS_TOKEN", hide_env_values = true)]
    nats_token: Option<String>,
    /// An NKey seed (SU...).
    #[arg(long, env = "NATS_NKEY_SEED", hide_env_values = true)]
    nats_nkey_seed: Option<String>,
    /// A credentials file (.creds: a user JWT and its NKey seed).
    #[arg(long, env = "NATS_CREDS")]
    nats_creds: Option<PathBuf>,
    /// A PEM file of CA certificates for the server's TLS certificate.
    #[arg(long, env = "NATS_CA")]
    nats_ca: Option<PathBuf>,
    /// A PEM client certificate, for mutual TLS (with --nats-client-key).
    #[arg(long, env = "NATS_CLIENT_CERT")]
    nats_client_cert: Option<PathBuf>,
    /// The client certificate's PEM key.
    #[arg(long, env = "NATS_CLIENT_KEY")]
    nats_client_key: Option<PathBuf>,
    /// Refuse a connection without TLS.
    #[arg(long, env = "NATS_TLS")]
    nats_tls: bool,
}

impl NatsArgs {
    pub(crate) fn settings(&self, name: &str) -> NatsSettings {
        NatsSettings {
            urls: self.nats_url.clone(),
            user: self.nats_user.clone(),
            password: self.nats_password.clone(),
            token: self.nats_token.clone(),
            nkey_seed: self.nats_nkey_seed.clone(),
            credentials_file: self.nats_creds.clone(),
            ca_file: self.nats_ca.clone(),
            client_cert: self.nats_client_cert.clone(),
            client_key: self.nats_client_key.clone(),
            require_tls: self.nats_tls,
            name: Some(name.to_owned()),
        }
    }

    /// Connects, with an error that names the servers and no secret.
    pub(crate) async fn connect(&self, name: &str) -> Result<async_nats::Client, String> {
        self.settings(name)
            .connect()
            .await
            .map_err(|e| e.to_string())
    }
}
