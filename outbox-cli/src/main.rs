//! `outbox`: the message relay as a daemon, and an operator's view of the outbox.
//!
//! ```text
//! outbox migrate                       apply the outbox and inbox migrations
//! outbox relay                         run the relay until SIGTERM or SIGINT
//! outbox status [--json] [--max-lag D] the queue, the lag, the dead letters
//! outbox dead-letters list|show ID     inspect the relay's dead letters
//! outbox retry ID | --all [--aggregate-type T]
//! outbox skip ID
//! outbox inbox-dead-letters list|show|discard CONSUMER MESSAGE_ID
//! outbox purge --older-than D          delete published, archived and inbox rows in batches
//! outbox tail [--subject S] [--all]    print the stream's events as they arrive
//! outbox grants COMPONENT ROLE         the GRANT statements a component needs (--check)
//! outbox replay --to-prefix P --to-stream S [--since T] [--after POSITION]
//!                                      publish the archive again, to a stream of its own
//! ```
//!
//! Every setting is a flag and an environment variable (`DATABASE_URL`, `NATS_URL`,
//! `OUTBOX_*`, `NATS_*`); `--help` names them and never shows a secret's value. Exit status:
//! 0 when the command did its work, 1 when `status --max-lag` finds the lag over the bound
//! (or a relay could not stop within `--shutdown-timeout`), 2 on an error.

mod nats;
mod operate;
mod relay;
mod replay;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use operate::DeadLetterCommand;

/// mimalloc (built without transparent huge pages) instead of glibc's malloc: the relay
/// allocates about a hundred times per event, in async-nats, tokio-postgres and diesel, and
/// glibc's malloc and free were a third of its instructions. Measured with
/// `relay_bench --phases 3` under callgrind: 69.1k instructions per relayed event on glibc,
/// 51.9k on mimalloc; peak memory 28 MB against 33 MB.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The outbox's operator command.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about, long_about = None)]
struct Cli {
    /// The URL of the database that holds the outbox: PostgreSQL's, or (built with the
    /// features `mysql`, `sqlite`) a `mysql://` URL or a SQLite file's path. PostgreSQL over
    /// TLS: `?sslmode=require`, or `verify-full` with `sslrootcert=<CA file>`; a client
    /// certificate: `sslcert=<PEM file>&sslkey=<PEM file>`; what the URL leaves out, from a
    /// service file (`service=`, `PGSERVICE`) and libpq's `PG...` variables. MySQL over TLS:
    /// `?ssl_mode=required`, or `verify_identity` with `ssl_ca=<CA file>`; a client
    /// certificate: `ssl_cert=<PEM file>&ssl_key=<PEM file>` (an RSA key); what the URL leaves
    /// out, from `MYSQL_TCP_PORT`, `MYSQL_PWD` and `MYSQL_UNIX_PORT`.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the outbox and inbox migrations (idempotent; safe from every replica at once).
    Migrate,
    /// Run the message relay until SIGTERM or SIGINT, then stop gracefully.
    Relay(Box<relay::RelayArgs>),
    /// Show what waits in the outbox: the queue, the lag, the dead letters.
    Status(operate::StatusArgs),
    /// Inspect the relay's dead letters: rows the broker rejected `max_attempts` times.
    #[command(subcommand)]
    DeadLetters(operate::DeadLetters),
    /// Put dead letters back in the queue (attempts reset; skipped ones too).
    Retry(operate::RetryArgs),
    /// Drop a dead letter from the queue: never published unless retried; its
    /// aggregate's later events flow.
    Skip(operate::SkipArgs),
    /// Inspect the messages inbox consumers dead-lettered, and discard those dealt with.
    #[command(subcommand)]
    InboxDeadLetters(operate::InboxDeadLetters),
    /// Delete published rows (kept by `--published mark` or `archive`) and inbox rows older
    /// than a duration, in bounded batches; queued rows and dead letters are never touched.
    Purge(operate::PurgeArgs),
    /// Print the stream's events as they arrive: subject, stream sequence, type, payload.
    Tail(Box<operate::TailArgs>),
    /// Print the GRANT statements that give a PostgreSQL role (or, with --mysql, a MySQL or
    /// MariaDB account) what a component needs (run them as the tables' owner, after
    /// `migrate`), or with --check tell whether DATABASE_URL's role holds them; the relay and
    /// the inbox name at start each privilege theirs lacks.
    Grants(operate::GrantsArgs),
    /// Publish the archive (`--published archive`) again to a stream of its own, each
    /// aggregate's events in order, for a consumer that joins after the live stream's limits
    /// removed them; its inbox then reads the live stream, where it drops what it applied.
    Replay(Box<replay::ReplayArgs>),
}

/// Durations as people write them: `90s`, `5m`, `7d`, `250ms`.
pub(crate) fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| e.to_string())
}

/// How a command ended.
pub(crate) enum Ended {
    Done,
    /// The command ran, and found the outbox unhealthy (exit 1).
    Unhealthy,
}

/// The logging flags of the long-running commands.
#[derive(Debug, Args, Clone)]
pub(crate) struct LogArgs {
    /// `human` lines, or `json` objects, one per event, on standard error. The level comes
    /// from `RUST_LOG` (default `info`; a value that is not a filter is refused).
    #[arg(long, env = "OUTBOX_LOG_FORMAT", default_value = "human", value_parser = ["human", "json"])]
    log_format: String,
}

impl LogArgs {
    /// Installs the subscriber that writes the command's log on standard error.
    ///
    /// # Errors
    ///
    /// `RUST_LOG` is set and holds a directive that is not a filter (`outbox=verbose`): the
    /// message names the variable, its value and the parser's complaint. A daemon that
    /// fell back to `info` instead would hide what its operator asked to see.
    pub(crate) fn install(&self) -> Result<(), String> {
        let filter = tracing_subscriber::EnvFilter::builder()
            .with_default_directive(tracing_subscriber::filter::LevelFilter::INFO.into())
            .from_env()
            .map_err(|error| {
                let value = std::env::var("RUST_LOG").unwrap_or_default();
                format!(
                    "RUST_LOG={value:?} is not a log filter: {error} (it takes a level, such as \
                     `debug`, or target=level directives separated by commas, such as \
                     `outbox_runtime=debug,info`)"
                )
            })?;
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr);
        if self.log_format == "json" {
            builder.json().init();
        } else {
            builder.init();
        }
        Ok(())
    }
}

/// Whether `url` names an in-memory SQLite database: `:memory:` (also as `sqlite://:memory:`)
/// or a `file:` URI of `:memory:` or with `mode=memory` (SQLite docs, "In-Memory Databases"
/// and "URI Filenames", section 3.3). A library may keep one inside its process; an operator
/// command's would hold nothing of anyone's.
fn sqlite_in_memory(url: &str) -> bool {
    let url = url.trim();
    let path = url.strip_prefix("sqlite://").unwrap_or(url);
    if path == ":memory:" {
        return true;
    }
    let Some(uri) = path.strip_prefix("file:") else {
        return false;
    };
    let uri = uri.split('#').next().unwrap_or_default();
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    path == ":memory:" || query.split('&').any(|parameter| parameter == "mode=memory")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("outbox: cannot start the async runtime: {error}");
            return ExitCode::from(2);
        }
    };
    let outcome = runtime.block_on(async {
        let database_url = || {
            let url = cli
                .database_url
                .clone()
                .ok_or_else(|| "no database: set DATABASE_URL or --database-url".to_owned())?;
            // A typo in the scheme (`postgress://`) would be taken for a SQLite file's path.
            url.parse::<outbox_runtime::database::Kind>()
                .map_err(|error| format!("DATABASE_URL: {error}"))?;
            if sqlite_in_memory(&url) {
                return Err(format!(
                    "DATABASE_URL: the SQLite database {url:?} is in memory: it lives in one \
                     connection of this process, where no other process (the service that \
                     writes the outbox, its relay) sees it, and is gone when the command ends; \
                     give the database file's path"
                ));
            }
            Ok::<_, String>(url)
        };
        match cli.command {
            Command::Migrate => operate::migrate(&database_url()?).await,
            Command::Relay(args) => relay::run(&database_url()?, *args).await,
            Command::Status(args) => operate::status(&database_url()?, args).await,
            Command::DeadLetters(command) => {
                operate::on_dead_letters(&database_url()?, DeadLetterCommand::Inspect(command))
                    .await
            }
            Command::Retry(args) => {
                operate::on_dead_letters(&database_url()?, DeadLetterCommand::Retry(args)).await
            }
            Command::Skip(args) => {
                operate::on_dead_letters(&database_url()?, DeadLetterCommand::Skip(args)).await
            }
            Command::InboxDeadLetters(command) => {
                operate::on_inbox_dead_letters(&database_url()?, command).await
            }
            Command::Purge(args) => operate::purge(&database_url()?, args).await,
            Command::Tail(args) => operate::tail(*args).await,
            Command::Grants(args) if args.check => {
                operate::check_grants(&database_url()?, args.component).await
            }
            Command::Grants(args) => operate::grants(args, cli.database_url.as_deref()),
            Command::Replay(args) => replay::run(&database_url()?, *args).await,
        }
    });
    match outcome {
        Ok(Ended::Done) => ExitCode::SUCCESS,
        Ok(Ended::Unhealthy) => ExitCode::from(1),
        Err(error) => {
            eprintln!("outbox: {error}");
            ExitCode::from(2)
        }
    }
}
