//! The operator's commands: migrate, status, dead letters, retry, skip, inbox dead letters,
//! purge, tail. Each prints what it did; the ones that list have a `--json` form for scripts.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use diesel_async::AsyncPgConnection;
use futures::StreamExt;
use outbox_runtime::database::OperatorConnection;
use outbox_runtime::{InboxConnection, MissingMigrations, dead_letter, inbox, outbox};
use serde_json::json;
use uuid::Uuid;

use crate::Ended;
use crate::nats::NatsArgs;

/// Waits for `connecting` (MySQL's connection to `database_url`) within the connect
/// timeout; the error names the database without its password.
#[cfg(feature = "mysql")]
async fn connect<C>(
    database_url: &str,
    connecting: impl std::future::Future<Output = diesel::ConnectionResult<C>>,
) -> Result<C, String> {
    let target = outbox_runtime::database::redacted(database_url);
    match tokio::time::timeout(
        outbox_runtime::database::DEFAULT_CONNECT_TIMEOUT,
        connecting,
    )
    .await
    {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(error)) => Err(format!(
            "cannot connect to the database at {target}: {error}"
        )),
        Err(_) => Err(format!(
            "cannot connect to the database at {target}: no answer within {:?}",
            outbox_runtime::database::DEFAULT_CONNECT_TIMEOUT
        )),
    }
}

/// `text` as it may be shown on one line of a terminal: each control character (line breaks,
/// tabs, the escape that starts a terminal's control sequence, C1 controls), Unicode's line
/// and paragraph separators and each Unicode bidirectional formatting character (which
/// reorders how the rest of the line is shown; CVE-2021-42574, "Trojan Source") written as
/// Rust escapes it (`\n`, `\u{1b}`, `\u{202e}`).
/// Every other character, quotes and backslashes included, is kept. A row's text (an error a
/// handler returned, an id a hand insert wrote) then keeps its line and cannot drive the
/// operator's terminal.
fn one_line(text: &str) -> Cow<'_, str> {
    escape_where(text, hidden, |c, shown| shown.extend(c.escape_debug()))
}

/// Pretty JSON (`{value:#}`) as it may be shown on a terminal: each [`hidden`] character left
/// raw in it (serde_json escapes U+0000-U+001F only, not DEL, the C1 controls, U+2028,
/// U+2029 or the bidi characters) written as a JSON escape (`\u009b`, `\u202e`), so the text
/// stays the same JSON with the same values. The line breaks between its members are kept:
/// inside strings serde_json has escaped every line break.
pub(crate) fn terminal_json(pretty: &str) -> Cow<'_, str> {
    // Every hidden character is in the Basic Multilingual Plane: four hex digits.
    escape_where(
        pretty,
        |c| c != '\n' && hidden(c),
        |c, shown| {
            // Writing to a String cannot fail.
            let _ = write!(shown, "\\u{:04x}", u32::from(c));
        },
    )
}

/// A character that would break a line, drive a terminal or reorder what it shows: a control
/// character, Unicode's line and paragraph separators (U+2028, U+2029: line breaks to the
/// editors and log viewers a copied line lands in, though not to a terminal) or a Unicode
/// bidirectional formatting character (CVE-2021-42574's list).
fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{2028}'..='\u{202e}'
            | '\u{2066}'..='\u{2069}')
}

/// `text` with each character for which `escaped` holds written by `escape` instead; borrowed
/// when there is none.
fn escape_where(
    text: &str,
    escaped: impl Fn(char) -> bool,
    escape: impl Fn(char, &mut String),
) -> Cow<'_, str> {
    if !text.contains(&escaped) {
        return text.into();
    }
    let mut shown = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if escaped(c) {
            escape(c, &mut shown);
        } else {
            shown.push(c);
        }
    }
    shown.into()
}

/// A database's error, as the operator reads it; a refusal for a privilege the role lacks on
/// the outbox's tables says what to grant (`outbox grants operator <role>`).
fn database_error(error: diesel::result::Error) -> String {
    let hint = outbox_runtime::privileges::refusal_hint(
        &error,
        outbox_runtime::privileges::Component::Operator,
    );
    format!("database error: {error}{}", hint.unwrap_or_default())
}

/// [`database_error`] for dropping the archive's days, which only `outbox_published`'s owner
/// may do (detaching a partition and dropping it: PostgreSQL 15 docs, ALTER TABLE and DROP
/// TABLE; no grant gives it): a role that does not own it is told so, and who does.
pub(crate) fn archive_error(error: diesel::result::Error) -> String {
    let not_owner = matches!(
        &error,
        diesel::result::Error::DatabaseError(_, info)
            if info.message().starts_with("must be owner of")
    );
    let hint = if not_owner {
        ": only outbox_published's owner may drop the archive's days (no grant gives it); \
         run this as the role that ran `outbox migrate`"
            .to_owned()
    } else {
        // A database that takes no writes, or a privilege the role lacks.
        outbox_runtime::privileges::refusal_hint(
            &error,
            outbox_runtime::privileges::Component::Operator,
        )
        .unwrap_or_default()
    };
    format!("database error: purging the archive: {error}{hint}")
}

/// Opens the SQLite file `url` names, which must exist unless `create` (only `migrate`
/// creates one: a mistyped path must not become an empty database); the error names it.
#[cfg(feature = "sqlite")]
fn open_sqlite(
    url: &str,
    create: bool,
) -> Result<outbox_runtime::sqlite::SqliteConnection, String> {
    if !create {
        sqlite_file_exists(url)?;
    }
    outbox_runtime::sqlite::establish(url).map_err(|e| {
        format!(
            "cannot open {}: {e}",
            outbox_runtime::database::redacted(url)
        )
    })
}

/// Fails, naming the path, when the SQLite file `url` names (a path, `sqlite://path` or a
/// `file:` URI: [`outbox_runtime::database::sqlite_file`]) does not exist.
#[cfg(feature = "sqlite")]
pub(crate) fn sqlite_file_exists(url: &str) -> Result<(), String> {
    match outbox_runtime::database::sqlite_file(url) {
        Some(path) if !path.exists() => Err(format!(
            "no SQLite database at {}: `outbox migrate` creates one there, or check \
             DATABASE_URL",
            path.display()
        )),
        _ => Ok(()),
    }
}

/// The error for a database this build cannot open.
fn unknown_database(database_url: &str) -> String {
    format!(
        "{} names a database this build of outbox does not know: build it with \
         `--features mysql` or `--features sqlite`",
        outbox_runtime::database::redacted(database_url)
    )
}

/// Applies the outbox migrations of the database `database_url` names: PostgreSQL's, or with
/// the features `mysql` and `sqlite` MySQL's and SQLite's.
pub(crate) async fn migrate(database_url: &str) -> Result<Ended, String> {
    use outbox_runtime::database::Kind;
    // Outbox tables where the URL does not look, before these migrations make a new outbox
    // where it does: said after them, in case the URL was meant for that outbox.
    let elsewhere = match Kind::of(database_url) {
        Kind::Sqlite => None,
        _ => match Operator::open(database_url).await {
            Ok(mut operator) => operator
                .missing_migrations()
                .await
                .ok()
                .flatten()
                .and_then(|missing| missing.elsewhere),
            Err(_) => None,
        },
    };
    let applied = match Kind::of(database_url) {
        Kind::Postgres => outbox_runtime::run_migrations(database_url)
            .await
            .map_err(|e| e.to_string())?,
        #[cfg(feature = "mysql")]
        Kind::Mysql => outbox_runtime::mysql::run_migrations(database_url)
            .await
            .map_err(|e| e.to_string())?,
        #[cfg(feature = "sqlite")]
        Kind::Sqlite => {
            let url = database_url.to_owned();
            tokio::task::spawn_blocking(move || {
                let mut conn = open_sqlite(&url, true)?;
                outbox_runtime::sqlite::run_migrations(&mut conn).map_err(|e| e.to_string())
            })
            .await
            .map_err(|e| e.to_string())??
        }
        #[allow(unreachable_patterns)]
        _ => return Err(unknown_database(database_url)),
    };
    if applied.is_empty() {
        println!("the outbox schema is up to date");
    } else {
        println!("applied {}: {}", applied.len(), applied.join(", "));
        if let Some(elsewhere) = elsewhere {
            println!("note: this is a new outbox; {elsewhere}");
        }
    }
    Ok(Ended::Done)
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Exit 1 when the outbox lag (the oldest waiting event's age) is over this: a liveness
    /// or readiness probe.
    #[arg(long, value_parser = crate::duration)]
    max_lag: Option<Duration>,
}

/// How many of the newest rows `status` reads for "published in the last minute".
const RECENT_WINDOW: i64 = 50_000;

/// A time in RFC 3339 (section 5.6), in UTC: `2026-12-03T23:22:20.498158Z`, what a script
/// reading the `--json` forms parses (Python's `datetime.fromisoformat`, JavaScript's `Date`,
/// PostgreSQL's `timestamptz`), where time's own text (`2026-12-03 23:22:20.498158 +00:00:00`)
/// is none of theirs. The outbox's tables keep their times in RFC 3339's years 0000 to 9999;
/// one outside them is shown in time's text rather than not at all.
fn rfc3339(at: time::OffsetDateTime) -> String {
    at.to_offset(time::UtcOffset::UTC)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| at.to_string())
}

/// A duration to the tenth of a second under a minute, to the second above.
fn shown(duration: Duration) -> String {
    if duration < Duration::from_secs(60) {
        format!("{:.1}s", duration.as_secs_f64())
    } else {
        humantime::format_duration(Duration::from_secs(duration.as_secs())).to_string()
    }
}

/// What `status` reads: the stats, the queue by type and the rows published in the last
/// minute.
async fn read_status(database_url: &str) -> Result<Status, String> {
    let mut operator = Operator::connect(database_url).await?;
    let stats = match &mut operator {
        Operator::Postgres(conn) => outbox::stats(conn).await.map_err(database_error)?,
        #[cfg(feature = "mysql")]
        Operator::Mysql(conn) => outbox_runtime::mysql::stats(conn)
            .await
            .map_err(database_error)?,
        #[cfg(feature = "sqlite")]
        Operator::Sqlite(conn) => conn
            .spawn_blocking(outbox_runtime::sqlite::stats)
            .await
            .map_err(database_error)?,
    };
    on_operator!(&mut operator, conn => {
        let by_type = outbox::queued_by_type(conn).await.map_err(database_error)?;
        let recent = outbox::published_last_minute(conn, RECENT_WINDOW)
            .await
            .map_err(database_error)?;
        let inbox_dead_letters = inbox::dead_letter_counts(conn)
            .await
            .map_err(database_error)?;
        Ok(Status {
            stats,
            by_type,
            recent,
            inbox_dead_letters,
        })
    })
}

/// What `status` shows.
struct Status {
    stats: outbox::OutboxStats,
    by_type: Vec<outbox::QueuedByType>,
    /// Rows published in the last minute.
    recent: i64,
    /// Each consumer's inbox dead letters, for those that have any.
    inbox_dead_letters: Vec<(String, i64)>,
}

/// Prints what waits in the outbox: the stats (queue, lag, dead letters), the queue by
/// type and the rows published in the last minute.
pub(crate) async fn status(database_url: &str, args: StatusArgs) -> Result<Ended, String> {
    let Status {
        stats,
        by_type,
        recent,
        inbox_dead_letters,
    } = read_status(database_url).await?;
    let inbox_total: i64 = inbox_dead_letters.iter().map(|(_, n)| n).sum();
    let lag = stats.lag();
    let over = args.max_lag.is_some_and(|max| lag > max);
    if args.json {
        let types: Vec<_> = by_type
            .iter()
            .map(|row| {
                json!({
                    "aggregate_type": row.aggregate_type,
                    "event_type": row.event_type,
                    "queued": row.queued,
                    "dead_letters": row.dead_letters,
                })
            })
            .collect();
        let report = json!({
            "queued": stats.queued,
            "lag_seconds": lag.as_secs_f64(),
            "oldest_queued_at": stats.oldest_queued_at.map(rfc3339),
            "dead_letters": stats.dead_letters,
            "blocked_aggregates": stats.dead_letters,
            "blocked_events": stats.blocked,
            "skipped_dead_letters": stats.skipped_dead_letters,
            "published_last_minute": recent,
            "by_type": types,
            "inbox_dead_letters": inbox_total,
            "inbox_dead_letters_by_consumer": inbox_dead_letters
                .iter()
                .map(|(consumer, n)| (consumer.clone(), json!(n)))
                .collect::<serde_json::Map<_, _>>(),
            "max_lag_seconds": args.max_lag.map(|max| max.as_secs_f64()),
            "lag_over_max": over,
        });
        println!("{report:#}");
    } else {
        println!("queued                  {}", stats.queued);
        println!(
            "lag                     {} (the oldest waiting event's age)",
            shown(lag)
        );
        println!(
            "dead letters            {} (as many aggregates blocked, {} {} waiting behind them)",
            stats.dead_letters,
            stats.blocked,
            if stats.blocked == 1 {
                "event"
            } else {
                "events"
            }
        );
        println!("skipped dead letters    {}", stats.skipped_dead_letters);
        if inbox_dead_letters.is_empty() {
            println!("inbox dead letters      0");
        } else {
            let each: Vec<String> = inbox_dead_letters
                .iter()
                .map(|(consumer, n)| format!("{} {n}", one_line(consumer)))
                .collect();
            println!(
                "inbox dead letters      {inbox_total} ({})",
                each.join(", ")
            );
        }
        println!(
            "published last minute   {recent} (marked or archived rows, counting up to {RECENT_WINDOW})"
        );
        if !by_type.is_empty() {
            // Padded by characters (a `{:<w$}` width counts characters, not bytes).
            let rows: Vec<_> = by_type
                .iter()
                .map(|row| {
                    (
                        one_line(&row.aggregate_type),
                        one_line(&row.event_type),
                        row,
                    )
                })
                .collect();
            let width = |column: fn(&(_, _, _)) -> &str, title: &str| {
                rows.iter()
                    .map(|row| column(row).chars().count())
                    .fold(title.len(), usize::max)
            };
            let width_a = width(|row| &row.0, "aggregate type");
            let width_e = width(|row| &row.1, "event type");
            println!();
            println!(
                "{:<width_a$}  {:<width_e$}  {:>10}  {:>12}",
                "aggregate type", "event type", "queued", "dead letters"
            );
            for (aggregate_type, event_type, row) in &rows {
                println!(
                    "{aggregate_type:<width_a$}  {event_type:<width_e$}  {:>10}  {:>12}",
                    row.queued, row.dead_letters
                );
            }
        }
        if let Some(max) = args.max_lag {
            println!();
            if over {
                println!(
                    "the lag is over --max-lag {}",
                    humantime::format_duration(max)
                );
            } else {
                println!(
                    "the lag is within --max-lag {}",
                    humantime::format_duration(max)
                );
            }
        }
    }
    Ok(if over { Ended::Unhealthy } else { Ended::Done })
}

/// How many a `list` shows, and in which form.
#[derive(Debug, Args)]
pub(crate) struct Listing {
    /// At most this many, at least 1.
    #[arg(long, default_value_t = 100, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(1..))]
    limit: i64,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
pub(crate) enum DeadLetters {
    /// The dead letters not published, oldest first: blocking ones and skipped ones.
    List(Listing),
    /// One dead letter whole: its error, payload and headers.
    Show {
        /// The row id (its ce-id).
        id: Uuid,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

fn letter_json(letter: &dead_letter::DeadLetter) -> serde_json::Value {
    json!({
        "id": letter.id,
        "aggregate_type": letter.aggregate_type,
        "aggregate_id": letter.aggregate_id,
        "aggregate_seq": letter.aggregate_seq,
        "event_type": letter.event_type,
        "subject": letter.subject,
        "attempts": letter.attempts,
        "last_error": letter.last_error,
        "dead_lettered_at": rfc3339(letter.dead_lettered_at),
        "skipped_at": letter.skipped_at.map(rfc3339),
        "waiting": letter.waiting,
    })
}

/// An operator's command on dead letters.
#[derive(Debug)]
pub(crate) enum DeadLetterCommand {
    Inspect(DeadLetters),
    Retry(RetryArgs),
    Skip(SkipArgs),
}

/// A connection to the outbox's database for the operator's functions, of the kind the URL
/// names.
pub(crate) enum Operator {
    // Boxed: the connections differ in size by hundreds of bytes.
    Postgres(Box<AsyncPgConnection>),
    #[cfg(feature = "mysql")]
    Mysql(Box<outbox_runtime::mysql::AsyncMysqlConnection>),
    #[cfg(feature = "sqlite")]
    Sqlite(Box<outbox_runtime::sqlite::AsyncSqliteConnection>),
}

/// Evaluates `$body` with `$conn` bound to the [`Operator`]'s connection (`&mut` it),
/// whatever its type.
macro_rules! on_operator {
    ($operator:expr, $conn:ident => $body:expr) => {
        match $operator {
            Operator::Postgres(boxed) => {
                let $conn = &mut **boxed;
                $body
            }
            #[cfg(feature = "mysql")]
            Operator::Mysql(boxed) => {
                let $conn = &mut **boxed;
                $body
            }
            #[cfg(feature = "sqlite")]
            Operator::Sqlite(boxed) => {
                let $conn = &mut **boxed;
                $body
            }
        }
    };
}
pub(crate) use on_operator;

/// What [`Operator::purge_archive`] removed from the archive (`--published archive`).
pub(crate) enum ArchivePurged {
    /// PostgreSQL's: whole days, each partition with its row estimate.
    Partitions(Vec<(String, i64)>),
    /// MySQL's and SQLite's (one table): rows.
    #[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
    Rows(usize),
}

impl Operator {
    /// Removes what the archive holds from longer ago than `older_than`: on PostgreSQL the
    /// partitions whose whole day is older (`outbox::drop_archived`), on MySQL and SQLite the
    /// rows, `batch` per statement (`mysql::purge_archived`, `sqlite::purge_archived`),
    /// `progress` hearing the running total.
    pub(crate) async fn purge_archive(
        &mut self,
        older_than: Duration,
        #[cfg_attr(
            not(any(feature = "mysql", feature = "sqlite")),
            allow(unused_variables)
        )]
        batch: i64,
        #[cfg_attr(
            not(any(feature = "mysql", feature = "sqlite")),
            allow(unused_variables)
        )]
        progress: impl FnMut(usize) + Send,
    ) -> diesel::QueryResult<ArchivePurged> {
        match self {
            Self::Postgres(conn) => outbox::drop_archived(conn, older_than)
                .await
                .map(|dropped| ArchivePurged::Partitions(dropped.partitions)),
            #[cfg(feature = "mysql")]
            Self::Mysql(conn) => {
                outbox_runtime::mysql::purge_archived(conn, older_than, batch, progress)
                    .await
                    .map(ArchivePurged::Rows)
            }
            #[cfg(feature = "sqlite")]
            Self::Sqlite(conn) => {
                outbox_runtime::sqlite::purge_archived(conn, older_than, batch, progress)
                    .await
                    .map(ArchivePurged::Rows)
            }
        }
    }

    /// Connects to the database `database_url` names: PostgreSQL, or with the features
    /// `mysql` and `sqlite` MySQL or a SQLite file; fails, naming them, when the database
    /// lacks migrations of this build (an `outbox` upgraded before `outbox migrate` ran),
    /// where a command would otherwise fail on a missing table or column.
    pub(crate) async fn connect(database_url: &str) -> Result<Self, String> {
        let mut operator = Self::open(database_url).await?;
        operator.require_migrations(database_url).await?;
        Ok(operator)
    }

    /// Fails naming the migrations of this build the database at `database_url` lacks, or
    /// the schemas or databases that hold the outbox tables where it looks at none.
    async fn require_migrations(&mut self, database_url: &str) -> Result<(), String> {
        let Some(missing) = self.missing_migrations().await.map_err(database_error)? else {
            return Ok(());
        };
        Err(format!(
            "the outbox schema of {} lacks {} of this outbox: {}; {}run `outbox migrate`",
            outbox_runtime::database::redacted(database_url),
            if missing.pending.len() == 1 {
                "a migration"
            } else {
                "migrations"
            },
            missing.pending.join(", "),
            missing.elsewhere.map_or(String::new(), |elsewhere| format!(
                "{elsewhere}; to make a new one here, "
            )),
        ))
    }

    /// This build's migrations the database has not applied; `None` when it has all.
    async fn missing_migrations(&mut self) -> diesel::QueryResult<Option<MissingMigrations>> {
        match self {
            Self::Postgres(conn) => outbox::missing_migrations(conn).await,
            #[cfg(feature = "mysql")]
            Self::Mysql(conn) => outbox_runtime::mysql::missing_migrations(conn).await,
            #[cfg(feature = "sqlite")]
            Self::Sqlite(conn) => {
                conn.spawn_blocking(outbox_runtime::sqlite::missing_migrations)
                    .await
            }
        }
    }

    /// Opens the connection [`connect`](Self::connect) checks.
    async fn open(database_url: &str) -> Result<Self, String> {
        use outbox_runtime::database::Kind;
        match Kind::of(database_url) {
            Kind::Postgres => Ok(Self::Postgres(Box::new(
                outbox_runtime::database::establish_postgres(
                    database_url,
                    outbox_runtime::database::DEFAULT_CONNECT_TIMEOUT,
                )
                .await
                .map_err(|error| error.to_string())?,
            ))),
            #[cfg(feature = "mysql")]
            Kind::Mysql => Ok(Self::Mysql(Box::new(
                connect(database_url, outbox_runtime::mysql::establish(database_url)).await?,
            ))),
            #[cfg(feature = "sqlite")]
            Kind::Sqlite => Ok(Self::Sqlite(Box::new(
                outbox_runtime::sqlite::AsyncSqliteConnection::new(open_sqlite(
                    database_url,
                    false,
                )?),
            ))),
            #[allow(unreachable_patterns)]
            _ => Err(unknown_database(database_url)),
        }
    }
}

/// Runs `command` on the database `database_url` names.
pub(crate) async fn on_dead_letters(
    database_url: &str,
    command: DeadLetterCommand,
) -> Result<Ended, String> {
    let mut operator = Operator::connect(database_url).await?;
    on_operator!(&mut operator, conn => command.run(conn).await)
}

impl DeadLetterCommand {
    async fn run<C: OperatorConnection>(self, conn: &mut C) -> Result<Ended, String> {
        match self {
            Self::Inspect(command) => dead_letters(conn, command).await,
            Self::Retry(args) => retry(conn, args).await,
            Self::Skip(args) => skip(conn, args).await,
        }
    }
}

async fn dead_letters<C: OperatorConnection>(
    conn: &mut C,
    command: DeadLetters,
) -> Result<Ended, String> {
    match command {
        DeadLetters::List(Listing { limit, json }) => {
            let letters = dead_letter::list(conn, limit)
                .await
                .map_err(database_error)?;
            print_list(&letters, json, "no dead letters", letter_json, |letter| {
                let state = match letter.skipped_at {
                    Some(_) => "skipped".to_owned(),
                    None => format!("blocks {} events", letter.waiting),
                };
                format!(
                    "{}  {} {} #{}  {}  attempts {}  {}  {}",
                    letter.id,
                    one_line(&letter.aggregate_type),
                    one_line(&letter.aggregate_id),
                    letter.aggregate_seq,
                    one_line(&letter.event_type),
                    letter.attempts,
                    state,
                    one_line(letter.last_error.as_deref().unwrap_or(""))
                )
            });
        }
        DeadLetters::Show { id, json } => {
            let Some(detail) = dead_letter::show(conn, id).await.map_err(database_error)? else {
                return Err(format!("{id} is not a dead letter"));
            };
            let mut value = letter_json(&detail.letter);
            value["event_version"] = json!(detail.event_version);
            value["partition_key"] = json!(detail.partition_key);
            value["occurred_at"] = json!(rfc3339(detail.occurred_at));
            value["correlation_id"] = json!(detail.correlation_id);
            value["payload"] =
                serde_json::from_str(&detail.payload).unwrap_or(json!(detail.payload));
            value["headers"] =
                serde_json::from_str(&detail.headers).unwrap_or(json!(detail.headers));
            print_one(&value, json);
        }
    }
    Ok(Ended::Done)
}

/// Prints `items`: a JSON line each (`as_json`) when `json`, else a line each (`as_line`),
/// or `none` when there are none.
fn print_list<T>(
    items: &[T],
    json: bool,
    none: &str,
    as_json: fn(&T) -> serde_json::Value,
    as_line: impl Fn(&T) -> String,
) {
    if json {
        for item in items {
            println!("{}", as_json(item));
        }
    } else if items.is_empty() {
        println!("{none}");
    } else {
        for item in items {
            println!("{}", as_line(item));
        }
    }
}

/// Prints `value` on one line when `json`, else indented for a reader, with what would drive
/// a terminal escaped ([`terminal_json`]).
fn print_one(value: &serde_json::Value, json: bool) {
    if json {
        println!("{value}");
    } else {
        println!("{}", terminal_json(&format!("{value:#}")));
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum InboxDeadLetters {
    /// The messages inbox consumers dead-lettered, oldest first.
    List {
        /// Only this consumer's.
        #[arg(long)]
        consumer: Option<String>,
        #[command(flatten)]
        listing: Listing,
    },
    /// One inbox dead letter whole: its error, headers and payload.
    Show {
        #[command(flatten)]
        key: InboxDeadLetterKey,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Delete an inbox dead letter once it has been dealt with, or with --all every one (of
    /// CONSUMER when given). The consumer's record of each message stays, so a redelivery of
    /// it is still never handled.
    Discard(DiscardArgs),
}

#[derive(Debug, Args)]
pub(crate) struct DiscardArgs {
    /// The consumer that dead-lettered it; with --all, only this consumer's.
    #[arg(required_unless_present = "all")]
    consumer: Option<String>,
    /// The message's ce-id (as `list` shows it).
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    message_id: Option<String>,
    /// The message's ce-source; needed only when the consumer dead-lettered messages of that
    /// id from several sources.
    #[arg(long, conflicts_with = "all")]
    source: Option<String>,
    /// Discard every dead letter (of CONSUMER when given, else of every consumer).
    #[arg(long)]
    all: bool,
}

/// Which inbox dead letter: a consumer's, by the message's id.
#[derive(Debug, Args)]
pub(crate) struct InboxDeadLetterKey {
    /// The consumer that dead-lettered it.
    consumer: String,
    /// The message's ce-id (as `list` shows it).
    message_id: String,
    /// The message's ce-source; needed only when the consumer dead-lettered messages of that
    /// id from several sources.
    #[arg(long)]
    source: Option<String>,
}

fn inbox_letter_json(letter: &inbox::DeadLetter) -> serde_json::Value {
    json!({
        "consumer": letter.consumer,
        "source": letter.source,
        "message_id": letter.message_id,
        "subject": letter.subject,
        "error": letter.error,
        "deliveries": letter.deliveries,
        "stream_sequence": letter.stream_sequence,
        "dead_lettered_at": rfc3339(letter.dead_lettered_at),
    })
}

/// Runs `command` on the inbox's dead letters in the database `database_url` names.
pub(crate) async fn on_inbox_dead_letters(
    database_url: &str,
    command: InboxDeadLetters,
) -> Result<Ended, String> {
    let mut operator = Operator::connect(database_url).await?;
    on_operator!(&mut operator, conn => inbox_dead_letters(conn, command).await)
}

async fn inbox_dead_letters<C: InboxConnection>(
    conn: &mut C,
    command: InboxDeadLetters,
) -> Result<Ended, String> {
    match command {
        InboxDeadLetters::List {
            consumer,
            listing: Listing { limit, json },
        } => {
            let letters = inbox::dead_letters(conn, consumer.as_deref(), limit)
                .await
                .map_err(database_error)?;
            let none = "no inbox dead letters";
            print_list(&letters, json, none, inbox_letter_json, |letter| {
                format!(
                    "{}  {}  {}  {}  deliveries {}  {}",
                    rfc3339(letter.dead_lettered_at),
                    one_line(&letter.consumer),
                    one_line(&letter.message_id),
                    one_line(&letter.subject),
                    letter.deliveries,
                    one_line(&letter.error)
                )
            });
        }
        InboxDeadLetters::Show { key, json } => {
            let source = key.source(conn).await?;
            let Some(detail) = inbox::dead_letter(conn, &key.consumer, &source, &key.message_id)
                .await
                .map_err(database_error)?
            else {
                return Err(key.none(&source));
            };
            let mut value = inbox_letter_json(&detail.letter);
            value["headers"] = detail.headers;
            value["payload_bytes"] = json!(detail.payload.len());
            // The payload as JSON when it is, else as text, else (bytes that are not UTF-8)
            // in hexadecimal.
            match serde_json::from_slice::<serde_json::Value>(&detail.payload) {
                Ok(payload) => value["payload"] = payload,
                Err(_) => match String::from_utf8(detail.payload) {
                    Ok(text) => value["payload"] = json!(text),
                    Err(bytes) => {
                        let hex: String = bytes
                            .as_bytes()
                            .iter()
                            .map(|byte| format!("{byte:02x}"))
                            .collect();
                        value["payload_hex"] = json!(hex);
                    }
                },
            }
            print_one(&value, json);
        }
        InboxDeadLetters::Discard(DiscardArgs {
            consumer: Some(consumer),
            message_id: Some(message_id),
            source,
            all: false,
        }) => {
            let key = InboxDeadLetterKey {
                consumer,
                message_id,
                source,
            };
            let source = key.source(conn).await?;
            if !inbox::discard_dead_letter(conn, &key.consumer, &source, &key.message_id)
                .await
                .map_err(database_error)?
            {
                return Err(key.none(&source));
            }
            println!(
                "discarded {}'s dead letter {}: the message stays recorded as handled",
                key.consumer, key.message_id
            );
        }
        InboxDeadLetters::Discard(DiscardArgs {
            consumer,
            all: true,
            ..
        }) => {
            let discarded = inbox::discard_dead_letters(conn, consumer.as_deref())
                .await
                .map_err(database_error)?;
            let of = consumer.map_or("every consumer".to_owned(), |c| format!("consumer {c}"));
            println!(
                "discarded {discarded} dead letters of {of}: their messages stay recorded as \
                 handled"
            );
        }
        InboxDeadLetters::Discard(_) => {
            return Err("discard takes a consumer and a message id, or --all".to_owned());
        }
    }
    Ok(Ended::Done)
}

impl InboxDeadLetterKey {
    /// The source the operator named, else the only one under which the consumer
    /// dead-lettered the message id; an error naming them when there are several, or none.
    async fn source<C: InboxConnection>(&self, conn: &mut C) -> Result<String, String> {
        if let Some(source) = &self.source {
            return Ok(source.clone());
        }
        let sources = inbox::dead_letter_sources(conn, &self.consumer, &self.message_id)
            .await
            .map_err(database_error)?;
        match <[String; 1]>::try_from(sources) {
            Ok([source]) => Ok(source),
            Err(sources) if sources.is_empty() => Err(format!(
                "consumer {} has no dead letter with the message id {}",
                self.consumer, self.message_id
            )),
            Err(sources) => Err(format!(
                "consumer {} has dead letters with the message id {} from {} sources ({}): \
                 name one with --source",
                self.consumer,
                self.message_id,
                sources.len(),
                // A source is a message's `ce-source`: whatever its publisher wrote.
                sources
                    .iter()
                    .map(|source| one_line(source))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// The error for no dead letter of this key from `source`.
    fn none(&self, source: &str) -> String {
        format!(
            "consumer {} has no dead letter with the message id {} from the source {source:?}",
            self.consumer, self.message_id
        )
    }
}

#[derive(Debug, Args)]
pub(crate) struct RetryArgs {
    /// The dead letter to retry.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    id: Option<Uuid>,
    /// Retry every dead letter (skipped ones included).
    #[arg(long)]
    all: bool,
    /// With --all: only those of this aggregate type.
    #[arg(long, requires = "all")]
    aggregate_type: Option<String>,
}

async fn retry<C: OperatorConnection>(conn: &mut C, args: RetryArgs) -> Result<Ended, String> {
    if let Some(id) = args.id {
        if dead_letter::retry(conn, id).await.map_err(database_error)? {
            println!("retried {id}: back in the queue, attempts reset");
            return Ok(Ended::Done);
        }
        return Err(format!("{id} is not a dead letter"));
    }
    let retried = dead_letter::retry_all(conn, args.aggregate_type.as_deref())
        .await
        .map_err(database_error)?;
    for id in &retried {
        println!("retried {id}");
    }
    println!("retried {} dead letters", retried.len());
    Ok(Ended::Done)
}

#[derive(Debug, Args)]
pub(crate) struct SkipArgs {
    /// The dead letter to skip.
    id: Uuid,
}

async fn skip<C: OperatorConnection>(conn: &mut C, args: SkipArgs) -> Result<Ended, String> {
    if dead_letter::skip(conn, args.id)
        .await
        .map_err(database_error)?
    {
        println!(
            "skipped {}: not published unless retried; its aggregate's later events flow",
            args.id
        );
        Ok(Ended::Done)
    } else {
        Err(format!("{} is not a blocking dead letter", args.id))
    }
}

#[derive(Debug, Args)]
pub(crate) struct PurgeArgs {
    /// Delete what was published (or handled, in the inbox) longer ago than this, archived
    /// rows (--published archive) included; on PostgreSQL drop the archive's days that ended
    /// longer ago than this.
    #[arg(long, value_parser = crate::duration)]
    older_than: Duration,
    /// Rows per DELETE, at least 1: each is a short transaction, so no lock is held long.
    #[arg(long, default_value_t = 10_000, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(1..))]
    batch: i64,
    /// Leave the inbox's rows alone. Without it, --older-than must be at least 66s, the
    /// longest a message may be redelivered with the default consumer and relay settings
    /// (an id purged sooner lets a duplicate be handled again).
    #[arg(long)]
    no_inbox: bool,
    /// Also delete the producers' dedup keys (#[event(dedup_key)]) taken longer ago than
    /// this; an event whose key is gone is written again. Kept when not given.
    #[arg(long, value_parser = crate::duration)]
    dedup_keys_older_than: Option<Duration>,
}

/// Deletes what `args` asks on the database `database_url` names: published rows, the
/// archive's old rows (PostgreSQL: its old days), dedup keys and the inbox's rows.
pub(crate) async fn purge(database_url: &str, args: PurgeArgs) -> Result<Ended, String> {
    if !args.no_inbox {
        refuse_an_inbox_purge_inside_redeliveries(args.older_than)?;
    }
    let mut operator = Operator::connect(database_url).await?;
    on_operator!(&mut operator, conn => purge_outbox(conn, &args).await)?;
    let mut progress = Progress::new();
    let purged = operator
        .purge_archive(args.older_than, args.batch, |deleted| {
            if deleted > 0 {
                progress.report(|| format!("outbox_published: {deleted} archived rows deleted"));
            }
        })
        .await
        .map_err(archive_error)?;
    match purged {
        ArchivePurged::Partitions(partitions) => {
            for (partition, rows) in &partitions {
                println!("dropped archive partition {partition} (about {rows} rows)");
            }
        }
        ArchivePurged::Rows(rows) => println!(
            "deleted {rows} archived rows older than {}",
            humantime::format_duration(args.older_than)
        ),
    }
    if !args.no_inbox {
        on_operator!(&mut operator, conn => purge_inbox(conn, &args).await)?;
    }
    Ok(Ended::Done)
}

/// Refuses, before anything is deleted, an inbox purge of rows handled less than
/// [`inbox_purge_floor`] ago: a duplicate of such a message may still arrive (redelivered by
/// JetStream, or republished by a relay past the stream's duplicate window), and an id purged
/// before it arrives lets it be handled twice.
fn refuse_an_inbox_purge_inside_redeliveries(older_than: Duration) -> Result<(), String> {
    let floor = inbox_purge_floor();
    if older_than >= floor {
        return Ok(());
    }
    Err(format!(
        "--older-than {} would purge inbox rows whose messages may still be redelivered: a \
         consumer with the default settings may redeliver for {} (InboxConfig's \
         own_redelivery_time) and a relay with the default settings republish for {} (its \
         redelivery_horizon), and a duplicate arriving after its id is gone is handled \
         again; purge the inbox with --older-than {} or more (longer where consumers or \
         relays are configured for longer redeliveries), or pass --no-inbox to leave the \
         inbox alone; nothing was deleted",
        humantime::format_duration(older_than),
        humantime::format_duration(own_redeliveries()),
        humantime::format_duration(relay_horizon()),
        humantime::format_duration(floor),
    ))
}

/// The shortest age of the inbox rows `outbox purge` deletes: the longer of a consumer's own
/// redeliveries and a relay's redelivery horizon, each with the default settings
/// (`InboxConfig::new`, `RelayConfig::new`), rounded up to the second. A running inbox purges
/// its own rows with its `retention`, which it checks against its own settings.
fn inbox_purge_floor() -> Duration {
    let longest = own_redeliveries().max(relay_horizon());
    Duration::from_secs(longest.as_secs() + u64::from(longest.subsec_nanos() > 0))
}

fn own_redeliveries() -> Duration {
    outbox_runtime::InboxConfig::new("consumer", "").own_redelivery_time()
}

fn relay_horizon() -> Duration {
    outbox_runtime::RelayConfig::new("").redelivery_horizon()
}

/// Deletes each consumer's inbox rows handled longer ago than `args` says, in batches.
async fn purge_inbox<C: InboxConnection>(conn: &mut C, args: &PurgeArgs) -> Result<(), String> {
    let mut progress = Progress::new();
    for consumer in inbox::consumers(conn).await.map_err(database_error)? {
        // A consumer's name is a row's text: an inbox row written by hand may hold anything.
        let shown = one_line(&consumer).into_owned();
        let mut handled = 0;
        loop {
            let deleted = inbox::purge(conn, &consumer, args.older_than, args.batch)
                .await
                .map_err(database_error)?;
            handled += deleted;
            if deleted < args.batch as usize {
                break;
            }
            // Progress only for a purge of more than one batch, as for the outbox's rows.
            progress.report(|| format!("outbox_inbox {shown}: {handled} rows deleted"));
        }
        println!("deleted {handled} inbox rows of {shown}");
    }
    Ok(())
}

/// Deletes the published rows and (when asked) the dedup keys older than `args` says.
async fn purge_outbox<C: OperatorConnection>(conn: &mut C, args: &PurgeArgs) -> Result<(), String> {
    let started = Instant::now();
    let mut progress = Progress::new();
    let published = outbox::purge_published(conn, args.older_than, args.batch, |deleted| {
        if deleted == 0 {
            return;
        }
        progress.report(|| {
            format!(
                "outbox_events: {deleted} published rows deleted ({:.0}/s)",
                deleted as f64 / started.elapsed().as_secs_f64()
            )
        });
    })
    .await
    .map_err(database_error)?;
    println!(
        "deleted {published} published rows older than {}",
        humantime::format_duration(args.older_than)
    );
    if let Some(older_than) = args.dedup_keys_older_than {
        let keys = outbox::purge_dedup_keys(conn, older_than, args.batch)
            .await
            .map_err(database_error)?;
        println!(
            "deleted {keys} dedup keys older than {}",
            humantime::format_duration(older_than)
        );
    }
    Ok(())
}

/// Progress lines on standard error, at most one a second.
struct Progress {
    last: Option<Instant>,
}

impl Progress {
    fn new() -> Self {
        Self { last: None }
    }

    fn report(&mut self, line: impl FnOnce() -> String) {
        if self
            .last
            .is_none_or(|last| last.elapsed() >= Duration::from_secs(1))
        {
            eprintln!("{}", line());
            self.last = Some(Instant::now());
        }
    }
}

#[derive(Debug, Args)]
pub(crate) struct GrantsArgs {
    /// What the role runs: `service` (a service that commits units of work with events),
    /// `relay`, `inbox` (a consumer; give it `service` too if its handlers commit events), or
    /// `operator` (this command's other commands).
    pub(crate) component: outbox_runtime::privileges::Component,
    /// The role to grant to, exactly as PostgreSQL spells it (it is quoted); with --mysql, the
    /// account: `name` (any host; or a MariaDB role) or `name@host`.
    #[arg(required_unless_present = "check")]
    role: Option<String>,
    /// Instead of printing the statements, check that DATABASE_URL's role (or account) holds
    /// them: exit 0 if it does, 1 naming each privilege it lacks.
    #[arg(long, conflicts_with_all = ["role", "schema", "mysql"])]
    pub(crate) check: bool,
    /// The schema of the outbox's tables.
    #[arg(long, default_value = "public")]
    schema: String,
    /// MySQL's or MariaDB's statements instead, for the outbox's tables in this database
    /// (without it, those of DATABASE_URL's database when it is a `mysql://` URL).
    #[arg(long, value_name = "DATABASE", conflicts_with = "schema")]
    mysql: Option<String>,
}

/// Prints the `GRANT` statements that give a role (PostgreSQL) or an account (MySQL: with
/// `--mysql`, or a `mysql://` `database_url`) what a component needs.
pub(crate) fn grants(args: GrantsArgs, database_url: Option<&str>) -> Result<Ended, String> {
    use outbox_runtime::database::Kind;
    use outbox_runtime::privileges;
    let kind = database_url.and_then(|url| url.parse::<Kind>().ok());
    let mysql = match (args.mysql, kind, database_url) {
        (Some(database), _, _) => Some(database),
        (None, Some(Kind::Mysql), Some(url)) => Some(mysql_database(url).ok_or_else(|| {
            "DATABASE_URL is MySQL's and names no database: give the outbox's with --mysql \
             <database>"
                .to_owned()
        })?),
        (None, Some(Kind::Sqlite), _) => {
            return Err(
                "DATABASE_URL is a SQLite file: SQLite has no roles or grants (the \
                        file's permissions are what guard it)"
                    .to_owned(),
            );
        }
        _ => None,
    };
    let role = args.role.as_deref().unwrap_or_default();
    let sql = match &mysql {
        Some(database) => privileges::mysql_grants(args.component, role, database),
        None => privileges::grants(args.component, role, &args.schema),
    }
    .map_err(|error| error.to_string())?;
    print!("{sql}");
    Ok(Ended::Done)
}

/// `outbox grants <component> --check`: whether the role of `database_url` holds what
/// `component` needs (`privileges::check`), then whether the database has this build's
/// migrations, since a table the database lacks is not counted as a privilege lacking.
pub(crate) async fn check_grants(
    database_url: &str,
    component: outbox_runtime::privileges::Component,
) -> Result<Ended, String> {
    use outbox_runtime::privileges::{self, PrivilegeError};
    let mut operator = Operator::open(database_url).await?;
    let checked = match &mut operator {
        Operator::Postgres(conn) => privileges::check(&mut **conn, component).await,
        #[cfg(feature = "mysql")]
        Operator::Mysql(conn) => privileges::check(&mut **conn, component).await,
        #[cfg(feature = "sqlite")]
        Operator::Sqlite(_) => {
            return Err(
                "DATABASE_URL is a SQLite file: SQLite has no roles or grants (the \
                        file's permissions are what guard it)"
                    .to_owned(),
            );
        }
    };
    match checked {
        Ok(()) => {}
        Err(PrivilegeError::Missing(missing)) => {
            println!("{missing}");
            return Ok(Ended::Unhealthy);
        }
        Err(error) => return Err(error.to_string()),
    }
    operator.require_migrations(database_url).await?;
    println!("DATABASE_URL's role holds every privilege the {component} needs");
    Ok(Ended::Done)
}

/// The database a `mysql://user@host:port/database?options` URL names, percent-decoded.
fn mysql_database(url: &str) -> Option<String> {
    let (_, rest) = url.split_once("://")?;
    let (_, path) = rest.split_once('/')?;
    let name = path.split(['?', '#']).next().unwrap_or_default();
    let name = percent_encoding::percent_decode_str(name).decode_utf8_lossy();
    (!name.is_empty()).then(|| name.into_owned())
}

#[derive(Debug, Args)]
pub(crate) struct TailArgs {
    #[command(flatten)]
    nats: NatsArgs,
    /// The stream.
    #[arg(long, env = "OUTBOX_STREAM", default_value = "EVENTS")]
    stream: String,
    /// The JetStream domain of the stream, when it is not the connected server's: the hub's,
    /// for a leaf node's client.
    #[arg(long, env = "OUTBOX_JETSTREAM_DOMAIN")]
    jetstream_domain: Option<String>,
    /// Only these subjects (a NATS filter such as `events.Order.>`).
    #[arg(long)]
    subject: Option<String>,
    /// Start from the stream's first message instead of the next one.
    #[arg(long)]
    all: bool,
    /// Stop after this many events (at least 1).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    count: Option<u64>,
}

pub(crate) async fn tail(args: TailArgs) -> Result<Ended, String> {
    use async_nats::jetstream::consumer::{DeliverPolicy, pull};
    // Before connecting: JetStream's own word for a malformed filter ("not a valid subset
    // of the interest subjects") does not say what is wrong, and an empty one follows all.
    if let Some(subject) = &args.subject {
        outbox_runtime::subject::validate_filter(subject).map_err(|e| format!("--subject: {e}"))?;
    }
    // A stream name with a space or a `.` would reach JetStream's API subject as two tokens.
    outbox_runtime::subject::validate_stream_name(&args.stream)
        .map_err(|e| format!("--stream: {e}"))?;
    let domain = args.jetstream_domain.as_deref();
    if let Some(domain) = domain {
        outbox_runtime::subject::validate_token(domain)
            .map_err(|e| format!("--jetstream-domain {domain:?} is not a JetStream domain: {e}"))?;
    }
    let nats = args.nats.connect("outbox-tail").await?;
    let stream = outbox_runtime::nats::jetstream_in(nats, domain)
        .get_stream(&args.stream)
        .await
        .map_err(|e| {
            if outbox_runtime::nats::stream_not_found(&e) {
                let place = match domain {
                    Some(domain) => format!("in JetStream domain {domain:?}"),
                    None => "on this NATS server".to_owned(),
                };
                return format!(
                    "no stream {:?} {place}: a relay creates it when it starts \
                     (`outbox relay`), or --stream names another",
                    args.stream
                );
            }
            let text = outbox_runtime::nats::jetstream_error_text_in(&e, domain);
            format!("stream {:?}: {text}", args.stream)
        })?;
    let consumer = stream
        .create_consumer(pull::OrderedConfig {
            deliver_policy: if args.all {
                DeliverPolicy::All
            } else {
                DeliverPolicy::New
            },
            filter_subject: args.subject.clone().unwrap_or_default(),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("cannot follow stream {:?}: {e}", args.stream))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| format!("cannot follow stream {:?}: {e}", args.stream))?;
    let mut seen = 0;
    while args.count.is_none_or(|count| seen < count) {
        let message = tokio::select! {
            message = messages.next() => message,
            _ = tokio::signal::ctrl_c() => break,
        };
        let Some(message) = message else { break };
        let message = message.map_err(|e| e.to_string())?;
        let sequence = message.info().map_or(0, |info| info.stream_sequence);
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|headers| headers.get(name))
                .map_or("-", |value| value.as_str())
                .to_owned()
        };
        println!(
            "{}  #{sequence}  {} v{}  {}",
            one_line(&message.subject),
            one_line(&header("ce-type")),
            one_line(&header("ce-eventversion")),
            one_line(&String::from_utf8_lossy(&message.payload))
        );
        seen += 1;
    }
    Ok(Ended::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The archive's retention says why the database refused it: a role that does not own
    /// the archive, one that lacks a privilege on it, a database that takes no writes. Before,
    /// only the first had a hint.
    #[test]
    fn an_archive_purge_refused_says_why() {
        use diesel::result::{DatabaseErrorKind, Error};
        let error = |kind, message: &str| Error::DatabaseError(kind, Box::new(message.to_owned()));
        for (error, says) in [
            (
                error(
                    DatabaseErrorKind::Unknown,
                    "must be owner of table outbox_published_20261201",
                ),
                ": only outbox_published's owner may drop the archive's days",
            ),
            (
                error(
                    DatabaseErrorKind::Unknown,
                    "permission denied for table outbox_published",
                ),
                ": the role the operator logs in as lacks a privilege the operator needs",
            ),
            (
                error(
                    DatabaseErrorKind::ReadOnlyTransaction,
                    "cannot execute DELETE in a read-only transaction",
                ),
                ": the database takes no writes (a hot standby",
            ),
        ] {
            let shown = archive_error(error);
            assert!(
                shown.starts_with("database error: purging the archive: ") && shown.contains(says),
                "{shown}"
            );
        }
    }

    /// A row's text keeps its line and cannot drive the terminal: control characters and
    /// bidirectional overrides escaped, everything else (quotes, backslashes, accents, CJK,
    /// emoji) as it is, and text with nothing to escape not copied.
    #[test]
    fn one_line_escapes_what_would_break_the_line_or_drive_the_terminal() {
        assert_eq!(
            one_line("first\nsecond\r\tthird"),
            "first\\nsecond\\r\\tthird"
        );
        assert_eq!(
            one_line("\u{1b}[2J\u{1b}]0;title\u{7}red"),
            "\\u{1b}[2J\\u{1b}]0;title\\u{7}red"
        );
        assert_eq!(one_line("a\u{85}b\u{0}c"), "a\\u{85}b\\0c");
        assert_eq!(
            one_line("line\u{2028}paragraph\u{2029}end"),
            "line\\u{2028}paragraph\\u{2029}end"
        );
        assert_eq!(
            one_line("user\u{202e}gnp.exe\u{2066}x\u{2069}\u{200f}"),
            "user\\u{202e}gnp.exe\\u{2066}x\\u{2069}\\u{200f}"
        );
        let kept = r#"field "name": expected `\d+`, got 'é' (注文 📦)"#;
        assert_eq!(one_line(kept), kept);
        assert!(matches!(one_line(kept), Cow::Borrowed(_)));
    }

    /// The human `show`: the characters serde_json leaves raw (DEL, C1 controls, U+2028,
    /// bidi overrides) as JSON escapes, the same JSON; its structure's line breaks kept.
    #[test]
    fn terminal_json_escapes_what_serde_json_leaves_raw_and_stays_the_same_json() {
        let value = serde_json::json!({
            "error": "a\u{9b}31mred\u{7f} \u{202e}txt.exe\nnext \u{1b}[2J\u{2028}",
            "kept": "é 注文 📦 \"quoted\" \\",
        });
        let pretty = format!("{value:#}");
        let shown = terminal_json(&pretty);
        assert!(
            !shown.contains(|c: char| c != '\n' && hidden(c)),
            "{shown:?}"
        );
        assert!(
            shown.contains(r"a\u009b31mred\u007f \u202etxt.exe\nnext \u001b[2J\u2028"),
            "{shown}"
        );
        assert_eq!(shown.lines().count(), pretty.lines().count());
        let parsed: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(parsed, value);
        let plain = format!("{:#}", serde_json::json!({"kept": "é 注文 📦"}));
        assert!(matches!(terminal_json(&plain), Cow::Borrowed(_)));
    }

    /// The floor `--no-inbox`'s help names (66s): the default relay's redelivery horizon
    /// (5 s ack, 30 s statement, 30 s backoff, 0.5 s poll), longer than the default
    /// consumer's own redeliveries (40 s), rounded up.
    #[test]
    fn the_inbox_purge_floor_is_the_default_relays_horizon_rounded_up() {
        assert_eq!(own_redeliveries(), Duration::from_secs(40));
        assert_eq!(relay_horizon(), Duration::from_millis(65_500));
        assert_eq!(inbox_purge_floor(), Duration::from_secs(66));
        assert!(refuse_an_inbox_purge_inside_redeliveries(Duration::from_secs(66)).is_ok());
        let refused =
            refuse_an_inbox_purge_inside_redeliveries(Duration::from_millis(65_999)).unwrap_err();
        assert!(
            refused.contains("--older-than 1m 5s 999ms would purge inbox rows"),
            "{refused}"
        );
        assert!(refused.contains("--older-than 1m 6s or more"), "{refused}");
        assert!(refused.contains("--no-inbox"), "{refused}");
    }
}
