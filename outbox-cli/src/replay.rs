//! `outbox replay`: the archive published again to a stream of its own
//! (`outbox_runtime::replay`), for a consumer that joins after the live stream's limits
//! removed the events it needs.

use std::time::{Duration, SystemTime};

use clap::Args;
use humantime::Duration as Span;
use outbox_runtime::privileges::Component;
use outbox_runtime::replay::{
    ArchivePosition, DUPLICATE_WINDOW, ReplayConfig, ReplayError, ReplayReport, replay_archive,
};
use outbox_runtime::{StreamSettings, SubjectPrefix, Topology};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::Ended;
use crate::nats::NatsArgs;
use crate::operate::{Operator, on_operator, terminal_json};

#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    #[command(flatten)]
    nats: NatsArgs,
    /// The producer's subject prefix (its relay's): the archived events under it are
    /// replayed.
    #[arg(long, env = "OUTBOX_SUBJECT_PREFIX", default_value_t = outbox_runtime::DEFAULT_SUBJECT_PREFIX.parse().expect("the default prefix"))]
    subject_prefix: SubjectPrefix,
    /// The messages' `ce-source`: the producer relay's --source, so that an inbox knows a
    /// replayed event from its live copy.
    #[arg(long, env = "OUTBOX_SOURCE", default_value = "/outbox")]
    source: String,
    /// The replay's subject prefix: `{subject-prefix}.{rest}` is published as
    /// `{to-prefix}.{rest}`. Not the producer's, nor one sharing its subjects.
    #[arg(long)]
    to_prefix: SubjectPrefix,
    /// The replay's stream, capturing `{to-prefix}.>`: created when missing, and never one
    /// that captures the producer's subjects.
    #[arg(long)]
    to_stream: String,
    /// The replay stream's replicas in a cluster (1 to 5), when it is created.
    #[arg(long, default_value_t = 1)]
    to_replicas: usize,
    /// How long the replay stream keeps a message, when it is created (0s: until a limit
    /// removes it); a replay for one consumer can expire once it has read it.
    #[arg(long, default_value = "0s")]
    to_max_age: Span,
    /// The replay stream's duplicate window, when it is created: default 10s
    /// (`outbox_runtime::replay::DUPLICATE_WINDOW`; no longer than --to-max-age), where a
    /// stream's default of 2m holds 115-252 bytes of the broker's memory per event replayed
    /// in the last 2 minutes (millions of ids at a replay's rate).
    #[arg(long)]
    to_duplicate_window: Option<Span>,
    /// Only events published at or after this time: RFC 3339 (`2026-01-31T00:00:00Z`), or a
    /// duration ago (`30d`).
    #[arg(long, value_parser = moment)]
    since: Option<OffsetDateTime>,
    /// Only events published before this time (as --since).
    #[arg(long, value_parser = moment)]
    before: Option<OffsetDateTime>,
    /// Only events of this aggregate type (repeat it for several).
    #[arg(long = "aggregate-type")]
    aggregate_types: Vec<String>,
    /// Resume after this position, as a replay that stopped printed it: a JSON array
    /// `["Order","o-17",42,"<event id>"]`.
    #[arg(long)]
    after: Option<ArchivePosition>,
    /// Events read and published per page (1 to 100,000).
    #[arg(long, default_value_t = 1_000)]
    batch_size: usize,
    /// How long a publish waits for its ack.
    #[arg(long, default_value = "5s")]
    ack_timeout: Span,
}

/// A time as an operator writes it: RFC 3339, or a duration before now.
fn moment(text: &str) -> Result<OffsetDateTime, String> {
    if let Ok(time) = OffsetDateTime::parse(text, &Rfc3339) {
        return Ok(time);
    }
    let ago: Duration = humantime::parse_duration(text).map_err(|_| {
        format!(
            "{text:?} is neither an RFC 3339 time (2026-01-31T00:00:00Z) nor a duration ago \
             (30d, 12h)"
        )
    })?;
    SystemTime::now()
        .checked_sub(ago)
        .map(OffsetDateTime::from)
        .ok_or_else(|| format!("{text:?} ago is before what this system's clock can tell"))
}

impl ReplayArgs {
    fn config(&self) -> ReplayConfig {
        let max_age: Duration = self.to_max_age.into();
        let duplicate_window = match self.to_duplicate_window {
            Some(window) => window.into(),
            None if !max_age.is_zero() => DUPLICATE_WINDOW.min(max_age),
            None => DUPLICATE_WINDOW,
        };
        let to = Topology::new(
            self.to_prefix.clone(),
            StreamSettings {
                name: self.to_stream.clone(),
                replicas: self.to_replicas,
                max_age,
                duplicate_window,
                ..StreamSettings::default()
            },
        );
        let mut config = ReplayConfig::new(self.subject_prefix.clone(), to);
        config.source = self.source.clone();
        config.published_since = self.since;
        config.published_before = self.before;
        config.aggregate_types = self.aggregate_types.clone();
        config.after = self.after.clone();
        config.batch_size = self.batch_size;
        config.ack_timeout = self.ack_timeout.into();
        config
    }
}

/// Replays the archive of the database `database_url` names, printing the totals every
/// second on standard error, and at the end on standard output the totals and the last
/// position.
pub(crate) async fn run(database_url: &str, args: ReplayArgs) -> Result<Ended, String> {
    let config = args.config();
    // Before connecting: settings that cannot work are named whatever the servers' state.
    config.check().map_err(|error| error.to_string())?;
    let mut operator = Operator::connect(database_url).await?;
    let nats = args.nats.connect("outbox-replay").await?;
    let mut last_line = None::<std::time::Instant>;
    let progress = |report: &ReplayReport| {
        if last_line.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
            eprintln!(
                "replayed {} ({} held already), up to {}",
                events(report.published),
                report.duplicates,
                report.last.as_ref().map_or("-".to_owned(), shown)
            );
            last_line = Some(std::time::Instant::now());
        }
    };
    let replayed =
        on_operator!(&mut operator, conn => replay_archive(conn, nats, &config, progress).await);
    let report = replayed.map_err(|error| {
        // A role without SELECT on the archive is told what to grant.
        let hint = match &error {
            ReplayError::Database { source, .. } => {
                outbox_runtime::privileges::refusal_hint(source, Component::Operator)
            }
            _ => None,
        };
        terminal_json(&format!("{error}{}", hint.unwrap_or_default())).into_owned()
    })?;
    match &report.last {
        Some(last) if report.published > 0 => println!(
            "replayed {} to stream {} ({} it held already); the last: {} (--after it replays \
             what is archived since)",
            events(report.published),
            config.to.stream.name,
            report.duplicates,
            shown(last)
        ),
        _ => println!("no archived event matched: nothing replayed"),
    }
    Ok(Ended::Done)
}

/// `position` as a terminal may show it, and `--after` reads it back: its JSON with each
/// character that would drive the terminal or reorder the line (an aggregate id's) escaped.
fn shown(position: &ArchivePosition) -> String {
    terminal_json(&position.to_string()).into_owned()
}

/// `n events`, or `1 event`.
fn events(n: u64) -> String {
    if n == 1 {
        "1 event".to_owned()
    } else {
        format!("{n} events")
    }
}
