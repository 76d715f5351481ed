//! The `outbox` command against the real PostgreSQL and NATS: each command on a database of
//! the test's own, the relay daemon under SIGTERM, its metrics endpoint, and a NATS server
//! that requires credentials.

#[path = "../../tests/support/mod.rs"]
mod support;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use diesel_async::SimpleAsyncConnection;
use support::{NatsServer, TestEnv, wait_until};

const OUTBOX: &str = env!("CARGO_BIN_EXE_outbox");

/// The `outbox` command on `env`'s database and NATS, logging at `info`.
fn command(env: &TestEnv, nats_url: &str) -> Command {
    let mut command = Command::new(OUTBOX);
    command
        .env("DATABASE_URL", &env.database_url)
        .env("NATS_URL", nats_url)
        .env("RUST_LOG", "info");
    command
}

/// `outbox args...` on `env`'s database and NATS, to completion.
fn outbox(env: &TestEnv, nats_url: &str, args: &[&str]) -> Output {
    command(env, nats_url)
        .args(args)
        .output()
        .expect("run outbox")
}

/// `outbox args...` on `env`'s database and NATS, which must refuse them: its output once it
/// exits, or a panic naming `args` when it is still running after 30 s (it took them and
/// went on: a relay that started, a purge that loops).
fn refused(env: &TestEnv, nats_url: &str, args: &[&str]) -> Output {
    refused_as(
        command(env, nats_url).args(args),
        &format!("outbox {args:?} went on instead of refusing"),
    )
}

/// `command`, its output piped, which must refuse what it was given: its output once it
/// exits, or a panic saying `went_on` when it is still running after 30 s.
fn refused_as(command: &mut Command, went_on: &str) -> Output {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run outbox");
    exited_within_30_s(child, went_on)
}

/// `outbox args...` with NATS up and with NATS unreachable: each time it must refuse before
/// it connects anything (exit 2), its output holding every one of `says`.
fn refused_before_connecting(env: &TestEnv, args: &[&str], says: &[&str]) {
    for nats_url in [support::nats_url(), "nats://127.0.0.1:1".to_owned()] {
        let refused = refused(env, &nats_url, args);
        let output = text(&refused);
        let context = format!("{args:?} with NATS at {nats_url}: {output}");
        assert_eq!(refused.status.code(), Some(2), "{context}");
        for said in says {
            assert!(output.contains(said), "{said:?} not said by {context}");
        }
    }
}

/// `child`'s output once it exits; when it still runs after 30 s, kills it and panics with
/// `went_on` and what it wrote.
fn exited_within_30_s(mut child: std::process::Child, went_on: &str) -> Output {
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait for outbox").is_none() {
        if Instant::now() > deadline {
            child.kill().expect("kill outbox");
            let output = child.wait_with_output().expect("outbox's output");
            panic!("{went_on}:\n{}", text(&output));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("outbox's output")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A time a `--json` form printed, which must be RFC 3339 in UTC (`...Z`), what scripts parse:
/// they printed time's own text, `2026-12-03 23:22:20.498158 +00:00:00`.
#[track_caller]
fn rfc3339(value: &serde_json::Value) -> time::OffsetDateTime {
    let text = value
        .as_str()
        .unwrap_or_else(|| panic!("a time, not {value}"));
    assert!(text.ends_with('Z'), "{text}: in UTC");
    time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|e| panic!("{text} is not RFC 3339: {e}"))
}

/// How long ago `at` was.
fn age(at: time::OffsetDateTime) -> time::Duration {
    time::OffsetDateTime::now_utc() - at
}

/// Inserts a row by plain SQL; `state` is SQL for the columns that make it queued, a dead
/// letter, skipped or published.
async fn insert(env: &TestEnv, aggregate: &str, seq: i64, event: &str, state: &str) {
    env.conn()
        .await
        .batch_execute(&format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
             partition_key, subject, payload, occurred_at, dead_lettered_at, skipped_at, \
             published_at, last_error) \
             SELECT 'Order', '{aggregate}', {seq}, '{event}', '{aggregate}', \
                    '{p}.Order.{aggregate}.{event}', '{{\"n\": {seq}}}', {state}",
            p = env.prefix
        ))
        .await
        .unwrap();
}

const QUEUED: &str = "now() - interval '2 hours', NULL, NULL, NULL, NULL";
const DEAD: &str = "now(), now(), NULL, NULL, 'max payload exceeded'";
const SKIPPED: &str = "now(), now(), now(), NULL, 'max payload exceeded'";

/// A database the command cannot reach is named without its password, with why: the option
/// whose value is wrong, the refused connection, the server's message. (Before: "invalid
/// connection string" and "error connecting to server", nothing more.)
#[test]
fn a_database_it_cannot_reach_is_named_with_why() {
    for (url, says) in [
        (
            "postgres://u:s3cret@127.0.0.1:5432/db?sslmode=bogus",
            "cannot connect to the database at <a database URL that does not parse>: invalid \
             connection string: invalid value for option `sslmode`",
        ),
        (
            "postgres://u:s3cret@127.0.0.1:1/db",
            "cannot connect to the database at postgres://u@127.0.0.1:1/db: error connecting \
             to server: Connection refused (os error 111)",
        ),
        (
            "postgres://postgres:s3cret@127.0.0.1:5432/outbox_no_such_database",
            "cannot connect to the database at \
             postgres://postgres@127.0.0.1/outbox_no_such_database: database \
             \"outbox_no_such_database\" does not exist",
        ),
    ] {
        let output = Command::new(OUTBOX)
            .arg("status")
            .env("DATABASE_URL", url)
            .output()
            .expect("run outbox");
        assert_eq!(output.status.code(), Some(2), "{url}: {}", text(&output));
        assert!(text(&output).contains(says), "{url}: {}", text(&output));
        assert!(!text(&output).contains("s3cret"), "{}", text(&output));
    }
}

#[tokio::test]
async fn migrate_applies_then_says_up_to_date() {
    let env = TestEnv::unmigrated(&support::nats_url()).await;
    // Before `migrate`, the operator's commands name what is missing, not a missing table.
    for args in [
        &["status"][..],
        &["dead-letters", "list"],
        &["inbox-dead-letters", "list"],
        &["purge", "--older-than", "1d"],
    ] {
        let refused = outbox(&env, &support::nats_url(), args);
        assert_eq!(
            refused.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&refused)
        );
        assert!(
            text(&refused).contains("lacks migrations of this outbox: 20261121000001, ")
                && text(&refused).contains("20261205000017; run `outbox migrate`"),
            "{args:?}: {}",
            text(&refused)
        );
    }
    let first = outbox(&env, &support::nats_url(), &["migrate"]);
    assert!(first.status.success(), "{}", text(&first));
    assert!(
        text(&first).contains("applied 17: 20261121000001")
            && text(&first).contains("20261205000017"),
        "{}",
        text(&first)
    );
    let second = outbox(&env, &support::nats_url(), &["migrate"]);
    assert!(second.status.success());
    assert_eq!(text(&second).trim(), "the outbox schema is up to date");
}

/// `outbox status` on the database's URL, where the outbox was migrated into the schema
/// `orders` by a URL that names it: it names the schema that holds the outbox tables and the
/// URL option that names it, beside `outbox migrate` for a new outbox; before, it said only
/// to run `outbox migrate`, which on that URL makes a second, empty outbox. On the URL that
/// names the schema, it reports.
#[tokio::test]
async fn status_on_a_url_that_misses_the_outbox_schema_names_it() {
    let env = TestEnv::unmigrated(&support::nats_url()).await;
    env.conn()
        .await
        .batch_execute("CREATE SCHEMA orders")
        .await
        .unwrap();
    let in_orders = format!("{}?options=-csearch_path%3Dorders", env.database_url);
    let in_schema = |args: &[&str]| {
        command(&env, &support::nats_url())
            .env("DATABASE_URL", &in_orders)
            .args(args)
            .output()
            .expect("run outbox")
    };
    let migrated = in_schema(&["migrate"]);
    assert!(migrated.status.success(), "{}", text(&migrated));

    let refused = outbox(&env, &support::nats_url(), &["status"]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(
        text(&refused).contains(&format!(
            "the outbox schema of {} lacks migrations of this outbox: 20261121000001, ",
            outbox_runtime::database::redacted(&env.database_url)
        )) && text(&refused).contains(
            "20261205000017; schema orders holds outbox tables outside the search_path \
             (\"$user\", public): to use that outbox, name it in the URL \
             (`?options=-csearch_path%3Dorders`) or the role's search_path, as the URL its \
             migrations ran on did; to make a new one here, run `outbox migrate`"
        ),
        "{}",
        text(&refused)
    );
    let status = in_schema(&["status"]);
    assert!(status.status.success(), "{}", text(&status));

    // Migrated all the same: a new outbox there, said so, with where the other one is.
    let second = outbox(&env, &support::nats_url(), &["migrate"]);
    assert!(second.status.success(), "{}", text(&second));
    assert!(
        text(&second).contains("applied 17: ")
            && text(&second).contains(
                "note: this is a new outbox; schema orders holds outbox tables outside the \
                 search_path (\"$user\", public): to use that outbox, name it in the URL \
                 (`?options=-csearch_path%3Dorders`) or the role's search_path, as the URL its \
                 migrations ran on did"
            ),
        "{}",
        text(&second)
    );
    let status = outbox(&env, &support::nats_url(), &["status"]);
    assert!(status.status.success(), "{}", text(&status));
}

/// A deployment that gives the database's URL without TLS options and sets libpq's
/// `PGSSLMODE` and `PGSSLROOTCERT` beside it (a URL from one secret, the TLS settings from
/// the pod's environment): the command connects over TLS, verifying the server, as `psql`
/// does. Before, it connected without TLS, and a server that takes TLS sessions only refused
/// it. A `PGSSLMODE` that is no mode is refused naming the variable.
#[tokio::test]
async fn migrate_takes_postgresqls_tls_settings_from_libpqs_environment() {
    let certificates = support::postgres::TestCertificates::new();
    let server = support::postgres::PostgresServer::start_with_tls(&certificates).await;
    server.create_database("orders").await;
    let url = format!("postgres://postgres@localhost:{}/orders", server.port);
    let migrate = |environment: &[(&str, &str)]| {
        let mut command = Command::new(OUTBOX);
        command
            .env("DATABASE_URL", &url)
            .env_remove("PGSSLMODE")
            .env_remove("PGSSLROOTCERT")
            .envs(environment.iter().copied())
            .arg("migrate");
        command.output().expect("run outbox")
    };
    // PGSSLMODE=disable: no TLS, which the server refuses; the error says what asks for it.
    let without_tls = migrate(&[("PGSSLMODE", "disable")]);
    assert!(
        !without_tls.status.success()
            && text(&without_tls).contains(
                "no encryption (the server takes this session only over TLS, and \
                 sslmode=disable asks for none: sslmode=require, or verify-full with \
                 sslrootcert, asks for it)"
            ),
        "{}",
        text(&without_tls)
    );
    let ca = certificates.path("ca.pem").display().to_string();
    let with_tls = migrate(&[("PGSSLMODE", "verify-full"), ("PGSSLROOTCERT", &ca)]);
    assert!(
        with_tls.status.success() && text(&with_tls).contains("applied 17: "),
        "{}",
        text(&with_tls)
    );
    let typo = migrate(&[("PGSSLMODE", "verfy-full")]);
    assert!(
        !typo.status.success()
            && text(&typo).contains(
                "PGSSLMODE \"verfy-full\" is not a mode the toolkit takes: one of disable, \
                 prefer, require, verify-ca, verify-full"
            ),
        "{}",
        text(&typo)
    );
}

/// A deployment that gives the database's URL without the password, the password kept where
/// libpq finds it: `PGPASSWORD`, or the password file (the URL's `passfile`, `PGPASSFILE`, or
/// `~/.pgpass`), on a
/// server that asks for it. Before, the command connected without one, and the server refused
/// it ("password missing"). A password file its group may read is ignored with a warning, as
/// libpq ignores it; the password is in no output.
#[tokio::test]
async fn a_password_kept_where_libpq_finds_it_is_used() {
    use diesel_async::{AsyncConnection, AsyncPgConnection};
    use std::os::unix::fs::PermissionsExt as _;
    const PASSWORD: &str = "s3cret-in-a-file";

    let server = support::postgres::PostgresServer::start_with_passwords().await;
    server.create_database("orders").await;
    AsyncPgConnection::establish(&server.url("postgres"))
        .await
        .unwrap()
        .batch_execute(&format!(
            "CREATE ROLE app LOGIN PASSWORD '{PASSWORD}'; ALTER DATABASE orders OWNER TO app"
        ))
        .await
        .unwrap();
    let home = std::env::temp_dir().join(format!("outbox-cli-home-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&home).unwrap();
    let url = format!("postgres://app@127.0.0.1:{}/orders", server.port);
    let run = |args: &[&str], environment: &[(&str, &str)]| {
        let output = Command::new(OUTBOX)
            .args(args)
            .env("DATABASE_URL", &url)
            .env("HOME", &home)
            .env_remove("PGPASSWORD")
            .env_remove("PGPASSFILE")
            .env_remove("PGUSER")
            .envs(environment.iter().copied())
            .output()
            .expect("run outbox");
        assert!(!text(&output).contains(PASSWORD), "{}", text(&output));
        output
    };
    let without = run(&["migrate"], &[]);
    assert!(
        !without.status.success() && text(&without).contains("password missing"),
        "{}",
        text(&without)
    );
    let migrated = run(&["migrate"], &[("PGPASSWORD", PASSWORD)]);
    assert!(
        migrated.status.success() && text(&migrated).contains("applied 17: "),
        "{}",
        text(&migrated)
    );
    let file = home.join("outbox.pgpass");
    std::fs::write(
        &file,
        format!(
            "# another server's first\n\
             db.internal:5432:*:app:not-this-one\n\
             127.0.0.1:{}:orders:app:{PASSWORD}\n",
            server.port
        ),
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let passfile = file.to_str().unwrap();
    let status = run(&["status"], &[("PGPASSFILE", passfile)]);
    assert!(status.status.success(), "{}", text(&status));
    // libpq's `passfile` option, in the URL.
    let with_passfile = format!("{url}?passfile={passfile}");
    let status = run(&["status"], &[("DATABASE_URL", &with_passfile)]);
    assert!(status.status.success(), "{}", text(&status));
    // `~/.pgpass`, without PGPASSFILE.
    std::fs::copy(&file, home.join(".pgpass")).unwrap();
    std::fs::set_permissions(home.join(".pgpass"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let status = run(&["status"], &[]);
    assert!(status.status.success(), "{}", text(&status));
    // No user in the URL nor PGUSER: the password file is searched for libpq's default user,
    // the operating system's. Before, "password missing".
    let me = Command::new("id")
        .arg("-un")
        .output()
        .expect("run id")
        .stdout;
    let me = String::from_utf8(me).unwrap().trim().to_owned();
    AsyncPgConnection::establish(&server.url("postgres"))
        .await
        .unwrap()
        .batch_execute(&format!(
            "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{me}') THEN \
             CREATE ROLE \"{me}\"; END IF; END $$; \
             ALTER ROLE \"{me}\" LOGIN SUPERUSER PASSWORD '{PASSWORD}'"
        ))
        .await
        .unwrap();
    let without_user = format!("postgres://127.0.0.1:{}/orders", server.port);
    let status = run(
        &["status"],
        &[("DATABASE_URL", &without_user), ("PGPASSFILE", passfile)],
    );
    assert!(
        !status.status.success() && text(&status).contains("password missing"),
        "no line for {me} yet: {}",
        text(&status)
    );
    let mut lines = std::fs::read_to_string(&file).unwrap();
    lines.push_str(&format!(
        "127.0.0.1:{}:orders:{me}:{PASSWORD}\n",
        server.port
    ));
    std::fs::write(&file, lines).unwrap();
    let status = run(
        &["status"],
        &[("DATABASE_URL", &without_user), ("PGPASSFILE", passfile)],
    );
    assert!(status.status.success(), "{me}: {}", text(&status));
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let open = run(&["status"], &[("PGPASSFILE", passfile)]);
    assert!(
        !open.status.success()
            && text(&open).contains(&format!(
                "password missing (the password file {passfile} was ignored: it has group or \
                 world access (mode 644), and its permissions should be u=rw (0600) or less, \
                 as libpq asks)"
            )),
        "{}",
        text(&open)
    );
    std::fs::remove_dir_all(&home).unwrap();
}

/// `outbox args...` on the database `url`, in an environment whose libpq variables are
/// `environment`'s alone (the test process's are removed), to completion.
fn outbox_in_libpqs_environment(args: &[&str], url: &str, environment: &[(&str, &str)]) -> Output {
    let mut command = Command::new(OUTBOX);
    command.args(args).env("DATABASE_URL", url);
    for variable in [
        "PGHOST",
        "PGHOSTADDR",
        "PGPORT",
        "PGUSER",
        "PGDATABASE",
        "PGOPTIONS",
        "PGSERVICE",
        "PGSERVICEFILE",
        "PGSYSCONFDIR",
        "PGCONNECT_TIMEOUT",
        "PGTARGETSESSIONATTRS",
    ] {
        command.env_remove(variable);
    }
    command
        .envs(environment.iter().copied())
        .output()
        .expect("run outbox")
}

/// A connection service file's section (PostgreSQL docs, "libpq: The Connection Service
/// File"), named by `PGSERVICE` or the URL's `service`, gives what the URL leaves out before
/// the environment does, as it does for `psql`: here its port comes before a `PGPORT` where
/// no server listens. A service in no file is named. Before, `PGSERVICE` was ignored (the
/// toolkit connected where the URL and the environment alone led, another database than
/// `psql`'s) and `service=` refused ("unknown option `service`").
#[tokio::test]
async fn a_service_file_gives_what_the_url_leaves_out_as_it_does_for_psql() {
    let server = support::postgres::PostgresServer::start().await;
    server.create_database("orders").await;
    let dir = std::env::temp_dir().join(format!("outbox-cli-service-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("user.conf");
    std::fs::write(
        &file,
        format!(
            "# the test's\n[orders]\nhost=127.0.0.1\nport={}\ndbname=orders\nuser=postgres\n",
            server.port
        ),
    )
    .unwrap();
    let closed = support::free_port().to_string();
    let run = |args: &[&str], url: &str, service: Option<&str>| {
        let user_file = file.to_str().unwrap();
        // The system's file, where a missing service is looked for last: none here.
        let system_directory = dir.join("etc");
        let mut environment = vec![
            ("PGPORT", closed.as_str()),
            ("PGSERVICEFILE", user_file),
            ("PGSYSCONFDIR", system_directory.to_str().unwrap()),
        ];
        environment.extend(service.map(|service| ("PGSERVICE", service)));
        let output = outbox_in_libpqs_environment(args, url, &environment);
        (output.status.success(), text(&output))
    };
    let (migrated, said) = run(&["migrate"], "postgres://", Some("orders"));
    assert!(migrated && said.contains("applied 17: "), "{said}");
    // Migrated where the service leads: its database on this server.
    let direct = format!("postgres://postgres@127.0.0.1:{}/orders", server.port);
    let (reported, said) = run(&["status"], &direct, None);
    assert!(reported, "{said}");
    let (reported, said) = run(&["status"], "postgres://?service=orders", None);
    assert!(reported, "{said}");
    let (reported, said) = run(&["status"], "service=orders", Some("missing"));
    assert!(reported, "{said}");
    let (reported, said) = run(&["status"], "postgres://", Some("missing"));
    assert!(
        !reported
            && said.contains(&format!(
                "definition of service \"missing\" not found (looked in {} and {})",
                file.display(),
                dir.join("etc").join("pg_service.conf").display()
            )),
        "{said}"
    );
    // The URL's own service, shown with the database (before, "<a database URL that does
    // not parse>").
    let (reported, said) = run(&["status"], "postgres://?service=absent", None);
    assert!(
        !reported
            && said.contains(
                "cannot connect to the database at postgres://?service=absent: definition of \
                 service \"absent\" not found"
            ),
        "{said}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `PGTARGETSESSIONATTRS=read-write` keeps, of a URL's hosts, the one that takes writes, as
/// libpq does: the first host here is a server whose sessions are read-only (a standby's
/// like), and the migrations land on the second. Before, the variable was ignored and
/// `outbox migrate` stopped at the first host.
#[tokio::test]
async fn pgtargetsessionattrs_keeps_the_host_that_takes_writes() {
    let standby =
        support::postgres::PostgresServer::start_with(&["default_transaction_read_only=on"]).await;
    let primary = support::postgres::PostgresServer::start().await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres",
        standby.port, primary.port
    );
    let output = outbox_in_libpqs_environment(&["migrate"], &url, &[]);
    assert!(
        !output.status.success()
            && text(&output).contains(
                "the database takes no writes (transaction_read_only is on: \
                 default_transaction_read_only"
            ),
        "{}",
        text(&output)
    );
    let output = outbox_in_libpqs_environment(
        &["migrate"],
        &url,
        &[("PGTARGETSESSIONATTRS", "read-write")],
    );
    assert!(
        output.status.success() && text(&output).contains("applied 17: "),
        "{}",
        text(&output)
    );
    let output = outbox_in_libpqs_environment(&["status"], &primary.url("postgres"), &[]);
    assert!(output.status.success(), "{}", text(&output));
}

/// A URL without a host, port, user or database takes them from libpq's `PGHOST`, `PGPORT`,
/// `PGUSER`, `PGDATABASE` and its server `options` from `PGOPTIONS`, as the same URL does in
/// `psql` and diesel's `PgConnection`; without a host anywhere, a Unix socket of libpq's
/// default directories, else `localhost`, named where the connection fails; over a socket,
/// without TLS whatever `sslmode` says, as libpq. Before, tokio-postgres refused such a URL:
/// "both host and hostaddr are missing".
#[tokio::test]
async fn a_url_that_leaves_out_the_host_takes_it_and_the_rest_where_libpq_does() {
    let server = support::postgres::PostgresServer::start().await;
    server.create_database("orders").await;
    let socket = server.socket_directory().to_str().unwrap().to_owned();
    let port = server.port.to_string();
    let run = outbox_in_libpqs_environment;
    // The server's Unix socket, named by PGHOST.
    let migrated = run(
        &["migrate"],
        "postgres:///orders",
        &[
            ("PGHOST", &socket),
            ("PGPORT", &port),
            ("PGUSER", "postgres"),
        ],
    );
    assert!(
        migrated.status.success() && text(&migrated).contains("applied 17: "),
        "{}",
        text(&migrated)
    );
    // No TLS over a socket, whatever the mode, as libpq: this server has none, and libpq's
    // default root certificate is not looked for. Before, rustls refused the socket ("error
    // performing TLS handshake: invalid dns name").
    let home = std::env::temp_dir().join(format!("outbox-cli-home-{}", uuid::Uuid::new_v4()));
    let home = home.to_str().unwrap();
    for mode in ["require", "verify-full"] {
        let url = format!("postgres:///orders?sslmode={mode}");
        let output = run(
            &["status"],
            &url,
            &[
                ("PGHOST", &socket),
                ("PGPORT", &port),
                ("PGUSER", "postgres"),
                ("HOME", home),
            ],
        );
        assert!(output.status.success(), "{url}: {}", text(&output));
    }
    // Nothing in the URL at all.
    let over_tcp = [
        ("PGHOST", "127.0.0.1"),
        ("PGPORT", port.as_str()),
        ("PGUSER", "postgres"),
        ("PGDATABASE", "orders"),
    ];
    let status = run(&["status", "--json"], "postgresql://", &over_tcp);
    assert!(status.status.success(), "{}", text(&status));
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(report["queued"], 0);
    // PGOPTIONS reaches the server: a search_path without the outbox's schema.
    let options = [&over_tcp[..], &[("PGOPTIONS", "-c search_path=elsewhere")]].concat();
    let elsewhere = run(&["status"], "postgresql://", &options);
    assert!(
        !elsewhere.status.success()
            && text(&elsewhere)
                .contains("schema public holds outbox tables outside the search_path"),
        "{}",
        text(&elsewhere)
    );
    // No host anywhere: libpq's socket directories hold no socket of a port no server
    // listens on, so `localhost`, which refuses, and the error says where it went.
    let nowhere = support::free_port().to_string();
    let refused = run(&["status"], "postgres:///orders", &[("PGPORT", &nowhere)]);
    assert!(
        !refused.status.success()
            && text(&refused).contains(&format!(
                "(from the environment: PGPORT={nowhere}; no host in the string nor PGHOST, \
                 and no socket .s.PGSQL.{nowhere} in /var/run/postgresql or /tmp: localhost)"
            )),
        "{}",
        text(&refused)
    );
    // A refusal names what the environment gave, which the URL shown with it does not.
    let stranger = [&over_tcp[..], &[("PGUSER", "nobody")]].concat();
    let refused = run(&["status"], "postgresql://", &stranger);
    assert!(
        !refused.status.success()
            && text(&refused).contains(&format!(
                "role \"nobody\" does not exist (from the environment: PGPORT={port}, \
                 PGHOST=127.0.0.1, PGUSER=nobody, PGDATABASE=orders)"
            )),
        "{}",
        text(&refused)
    );
    let typo = run(&["status"], "postgres:///orders", &[("PGPORT", "54321x")]);
    assert!(
        !typo.status.success()
            && text(&typo).contains("PGPORT=54321x: `54321x` is not a port number (1 to 65535)"),
        "{}",
        text(&typo)
    );
}

/// `outbox migrate` on a PostgreSQL older than 13, the outbox's oldest, is refused naming the
/// server's version, and applies nothing: not even diesel's table of migrations. Before, its
/// first migration failed half-way in words that named no version ("function
/// gen_random_uuid() does not exist"). Ignored by default: it needs a PostgreSQL 12 server,
/// `OUTBOX_TEST_OLD_POSTGRES_URL`, which `.ci/run` starts.
#[tokio::test]
#[ignore = "needs OUTBOX_TEST_OLD_POSTGRES_URL: a PostgreSQL 12 server, as .ci/run starts"]
async fn migrate_on_a_postgresql_older_than_13_is_refused_naming_its_version() {
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
    #[derive(diesel::QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    let server = std::env::var("OUTBOX_TEST_OLD_POSTGRES_URL")
        .expect("OUTBOX_TEST_OLD_POSTGRES_URL: the URL of a PostgreSQL 12 server");
    // A database of the test's own on it, so that it runs twice in a row.
    let name = format!("outbox_old_{}", uuid::Uuid::new_v4().simple());
    AsyncPgConnection::establish(&server)
        .await
        .unwrap()
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let (base, _) = server
        .rsplit_once('/')
        .expect("a URL that names a database");
    let url = format!("{base}/{name}");
    let output = Command::new(OUTBOX)
        .arg("migrate")
        .env("DATABASE_URL", &url)
        .output()
        .expect("run outbox");
    assert!(
        !output.status.success()
            && text(&output).contains(
                "cannot run the outbox migrations: the outbox needs PostgreSQL 13 or later, and \
                 this server is PostgreSQL 12."
            ),
        "{}",
        text(&output)
    );
    let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
    let table: Exists =
        diesel::sql_query("SELECT to_regclass('__diesel_schema_migrations') IS NOT NULL AS exists")
            .get_result(&mut conn)
            .await
            .unwrap();
    assert!(!table.exists, "a migration ran on PostgreSQL 12");
    drop(conn);
    AsyncPgConnection::establish(&server)
        .await
        .unwrap()
        .batch_execute(&format!("DROP DATABASE {name}"))
        .await
        .unwrap();
}

/// `outbox migrate` on a PostgreSQL that takes no writes says so, with why (its session is
/// read-only by `default_transaction_read_only`; the server is a hot standby), and that the
/// primary is the one to give, and applies nothing. Before, both were "an outbox migration
/// failed: cannot execute CREATE TABLE in a read-only transaction", which named neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_on_a_postgresql_that_takes_no_writes_names_why_and_asks_for_the_primary() {
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
    #[derive(diesel::QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    let mut server = support::postgres::PostgresServer::start().await;
    server.create_database("orders").await;
    let url = server.url("orders");
    let migrate = || {
        let output = Command::new(OUTBOX)
            .arg("migrate")
            .env("DATABASE_URL", &url)
            .output()
            .expect("run outbox");
        (output.status.code(), text(&output))
    };
    let applied_nothing = || async {
        let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
        let table: Exists = diesel::sql_query(
            "SELECT to_regclass('__diesel_schema_migrations') IS NOT NULL AS exists",
        )
        .get_result(&mut conn)
        .await
        .unwrap();
        !table.exists
    };
    let primary = "and the migrations write the outbox's tables; run them on the primary's URL \
                   (with several hosts, target_session_attrs=read-write picks it)";
    AsyncPgConnection::establish(&server.url("postgres"))
        .await
        .unwrap()
        .batch_execute("ALTER DATABASE orders SET default_transaction_read_only = on")
        .await
        .unwrap();
    let (code, said) = migrate();
    assert!(
        code == Some(2)
            && said.contains(
                "cannot run the outbox migrations: the database takes no writes \
                 (transaction_read_only is on: default_transaction_read_only, set for the \
                 database, the role or in the URL's options)"
            )
            && said.contains(primary),
        "{said}"
    );
    assert!(applied_nothing().await, "a migration ran: {said}");
    AsyncPgConnection::establish(&server.url("postgres"))
        .await
        .unwrap()
        .batch_execute("ALTER DATABASE orders RESET default_transaction_read_only")
        .await
        .unwrap();
    server.restart_as_standby().await;
    let (code, said) = migrate();
    assert!(
        code == Some(2)
            && said.contains(
                "cannot run the outbox migrations: the database takes no writes (a hot \
                 standby: pg_is_in_recovery() is true)"
            )
            && said.contains(primary),
        "{said}"
    );
    assert!(applied_nothing().await, "a migration ran: {said}");
}

/// On a hot standby (a replica's URL, say) the operator's commands that read work, and those
/// that write say that the database takes no writes and to give the primary. Before, `outbox
/// purge` said "database error: cannot execute SELECT in a read-only transaction".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_commands_read_a_hot_standby_and_name_it_where_they_write() {
    let mut server = support::postgres::PostgresServer::start().await;
    server.create_database("orders").await;
    let url = server.url("orders");
    let run = |args: &[&str]| {
        let output = Command::new(OUTBOX)
            .args(args)
            .env("DATABASE_URL", &url)
            .output()
            .expect("run outbox");
        (output.status.code(), text(&output))
    };
    let (code, said) = run(&["migrate"]);
    assert_eq!(code, Some(0), "{said}");
    server.restart_as_standby().await;
    let (code, said) = run(&["status"]);
    assert!(code == Some(0) && said.contains("queued"), "{said}");
    let (code, said) = run(&["purge", "--older-than", "1d"]);
    assert!(
        code == Some(2)
            && said.contains(
                "in a read-only transaction: the database takes no writes (a hot standby, or \
                 default_transaction_read_only on for the database or the role), and the \
                 operator writes the outbox's tables; give it the primary's URL"
            ),
        "{said}"
    );
}

#[tokio::test]
async fn status_shows_the_numbers_in_both_forms_and_max_lag_exits_1() {
    let env = TestEnv::new().await;
    insert(&env, "o-1", 1, "Placed", QUEUED).await;
    insert(&env, "o-1", 2, "Shipped", QUEUED).await;
    insert(&env, "o-2", 1, "Placed", DEAD).await;
    insert(&env, "o-3", 1, "Placed", SKIPPED).await;
    // Parked behind o-2's dead letter.
    insert(&env, "o-2", 2, "Shipped", "now(), NULL, NULL, NULL, NULL").await;
    env.conn()
        .await
        .batch_execute(
            "UPDATE outbox_events SET available_at = 'infinity' \
             WHERE aggregate_id = 'o-2' AND aggregate_seq = 2",
        )
        .await
        .unwrap();

    let table = outbox(&env, &support::nats_url(), &["status"]);
    assert!(table.status.success(), "{}", text(&table));
    let shown = text(&table);
    for line in [
        "queued                  3",
        "dead letters            1 (as many aggregates blocked, 1 event waiting behind them)",
        "skipped dead letters    1",
        "lag                     2h",
    ] {
        assert!(shown.contains(line), "{line:?} in:\n{shown}");
    }
    assert!(
        shown.contains("Order           Placed               1             1"),
        "{shown}"
    );
    assert!(
        shown.contains("Order           Shipped              2             0"),
        "{shown}"
    );

    let json = outbox(
        &env,
        &support::nats_url(),
        &["status", "--json", "--max-lag", "1h"],
    );
    assert_eq!(
        json.status.code(),
        Some(1),
        "the lag is 2 h: {}",
        text(&json)
    );
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(report["queued"], 3);
    assert_eq!(report["dead_letters"], 1);
    assert_eq!(report["blocked_events"], 1);
    assert_eq!(report["skipped_dead_letters"], 1);
    assert_eq!(report["lag_over_max"], true);
    assert!(report["lag_seconds"].as_f64().unwrap() > 7000.0);
    let oldest = age(rfc3339(&report["oldest_queued_at"]));
    assert!(
        oldest > time::Duration::hours(2) && oldest < time::Duration::minutes(125),
        "{oldest}"
    );
    assert_eq!(report["by_type"].as_array().unwrap().len(), 2);

    let healthy = outbox(&env, &support::nats_url(), &["status", "--max-lag", "3h"]);
    assert_eq!(healthy.status.code(), Some(0), "{}", text(&healthy));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_shown_retried_and_skipped() {
    let env = TestEnv::new().await;
    insert(&env, "o-1", 1, "Placed", DEAD).await;
    insert(&env, "o-2", 1, "Placed", DEAD).await;
    insert(&env, "o-3", 1, "Placed", SKIPPED).await;
    let nats = support::nats_url();

    // A limit of no rows is refused, naming the flag: it printed "no dead letters" over three.
    for limit in ["0", "-1"] {
        let refused = outbox(&env, &nats, &["dead-letters", "list", "--limit", limit]);
        assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
        assert!(
            text(&refused).contains(&format!("invalid value '{limit}' for '--limit <LIMIT>'")),
            "{}",
            text(&refused)
        );
    }
    let list = outbox(&env, &nats, &["dead-letters", "list", "--json"]);
    assert!(list.status.success(), "{}", text(&list));
    let letters: Vec<serde_json::Value> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(letters.len(), 3);
    for letter in &letters {
        assert!(age(rfc3339(&letter["dead_lettered_at"])) < time::Duration::minutes(5));
        match &letter["skipped_at"] {
            serde_json::Value::Null => assert_ne!(letter["aggregate_id"], "o-3"),
            skipped => assert!(age(rfc3339(skipped)) < time::Duration::minutes(5)),
        }
    }
    let id = |aggregate: &str| {
        letters
            .iter()
            .find(|l| l["aggregate_id"] == aggregate)
            .unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let show = outbox(&env, &nats, &["dead-letters", "show", &id("o-1"), "--json"]);
    let detail: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(detail["payload"], serde_json::json!({"n": 1}));
    assert_eq!(detail["last_error"], "max payload exceeded");
    assert!(age(rfc3339(&detail["occurred_at"])) < time::Duration::minutes(5));

    let retried = outbox(&env, &nats, &["retry", &id("o-1")]);
    assert!(
        text(&retried).contains(&format!("retried {}", id("o-1"))),
        "{}",
        text(&retried)
    );
    let skipped = outbox(&env, &nats, &["skip", &id("o-2")]);
    assert!(
        text(&skipped).contains(&format!("skipped {}", id("o-2"))),
        "{}",
        text(&skipped)
    );
    let again = outbox(&env, &nats, &["skip", &id("o-2")]);
    assert_eq!(
        again.status.code(),
        Some(2),
        "skipped already: {}",
        text(&again)
    );
    let all = outbox(
        &env,
        &nats,
        &["retry", "--all", "--aggregate-type", "Order"],
    );
    assert!(
        text(&all).contains("retried 2 dead letters"),
        "the two skipped ones: {}",
        text(&all)
    );

    // The relay publishes all three now.
    let mut relay = outbox_runtime::Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    while relay.relay_batch().await.unwrap().claimed > 0 {}
    assert_eq!(env.stream_len().await, 3);
}

/// The inbox's dead letters: counted by `status`, listed (of one consumer or all), shown
/// whole (a JSON payload as JSON, bytes that are not UTF-8 in hexadecimal), and discarded;
/// a message id that two sources used needs `--source`, and an unknown one is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_dead_letters_are_counted_listed_shown_and_discarded() {
    let env = TestEnv::new().await;
    let nats = support::nats_url();
    env.conn()
        .await
        .batch_execute(
            "INSERT INTO outbox_inbox_dead_letters (consumer, source, message_id, subject, \
                 headers, payload, error, deliveries, stream_sequence, dead_lettered_at) VALUES \
             ('billing', '/shop', 'm-1', 'app.Order.o-1.Placed', \
              '{\"ce-type\": [\"Placed\"]}', convert_to('{\"n\": 1}', 'UTF8'), \
              'handler failed 5 times: no account', 6, 41, now() - interval '2 minutes'), \
             ('billing', '/shop', 'm-2', 'app.Order.o-2.Placed', '{}', '\\xff00fe', \
              'payload is not JSON', 1, 42, now() - interval '1 minute'), \
             ('billing', '/legacy', 'm-1', 'app.Order.o-9.Placed', '{}', '', \
              'handler failed 5 times: no account', 5, 43, now()), \
             ('mailer', '/shop', 'm-3', 'app.Order.o-3.Shipped', '{}', \
              convert_to('plain text', 'UTF8'), 'came after a later event', 1, 44, now()); \
             INSERT INTO outbox_inbox (consumer, source, message_id) VALUES \
             ('billing', '/shop', 'm-1'), ('billing', '/shop', 'm-2'), \
             ('billing', '/legacy', 'm-1'), ('mailer', '/shop', 'm-3')",
        )
        .await
        .unwrap();

    let status = outbox(&env, &nats, &["status"]);
    assert!(
        text(&status).contains("inbox dead letters      4 (billing 3, mailer 1)"),
        "{}",
        text(&status)
    );
    let status = outbox(&env, &nats, &["status", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(report["inbox_dead_letters"], 4, "{report}");
    assert_eq!(
        report["inbox_dead_letters_by_consumer"],
        serde_json::json!({"billing": 3, "mailer": 1}),
        "{report}"
    );

    let lines = |output: &Output| -> Vec<serde_json::Value> {
        assert!(output.status.success(), "{}", text(output));
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    };
    let all = lines(&outbox(
        &env,
        &nats,
        &["inbox-dead-letters", "list", "--json"],
    ));
    let ids: Vec<_> = all.iter().map(|l| l["message_id"].clone()).collect();
    assert_eq!(ids.len(), 4, "{all:?}");
    assert_eq!(ids[..2], ["m-1", "m-2"], "the oldest first: {all:?}");
    let first = age(rfc3339(&all[0]["dead_lettered_at"]));
    assert!(
        first > time::Duration::minutes(2) && first < time::Duration::minutes(7),
        "{first}"
    );
    assert_eq!(all[0]["error"], "handler failed 5 times: no account");
    assert_eq!(
        (&all[0]["deliveries"], &all[0]["stream_sequence"]),
        (&6.into(), &41.into())
    );
    let mailer = lines(&outbox(
        &env,
        &nats,
        &[
            "inbox-dead-letters",
            "list",
            "--consumer",
            "mailer",
            "--json",
        ],
    ));
    assert_eq!(mailer.len(), 1, "{mailer:?}");
    assert_eq!(mailer[0]["subject"], "app.Order.o-3.Shipped");
    let table = outbox(&env, &nats, &["inbox-dead-letters", "list", "--limit", "1"]);
    let said = text(&table);
    assert!(
        said.contains("billing  m-1  app.Order.o-1.Placed  deliveries 6  handler failed"),
        "{said}"
    );
    assert!(!said.contains("m-2"), "one line: {said}");

    let show = |args: &[&str]| {
        let output = outbox(&env, &nats, args);
        assert!(output.status.success(), "{args:?}: {}", text(&output));
        serde_json::from_slice::<serde_json::Value>(&output.stdout).unwrap()
    };
    let json = show(&[
        "inbox-dead-letters",
        "show",
        "billing",
        "m-1",
        "--source",
        "/shop",
        "--json",
    ]);
    assert_eq!(json["payload"], serde_json::json!({"n": 1}), "{json}");
    assert_eq!(
        json["headers"],
        serde_json::json!({"ce-type": ["Placed"]}),
        "{json}"
    );
    let bytes = show(&["inbox-dead-letters", "show", "billing", "m-2", "--json"]);
    assert_eq!(
        (&bytes["payload_hex"], &bytes["payload_bytes"]),
        (&"ff00fe".into(), &3.into()),
        "{bytes}"
    );
    let plain = show(&["inbox-dead-letters", "show", "mailer", "m-3"]);
    assert_eq!(plain["payload"], "plain text", "{plain}");

    let ambiguous = outbox(
        &env,
        &nats,
        &["inbox-dead-letters", "show", "billing", "m-1"],
    );
    assert_eq!(ambiguous.status.code(), Some(2), "{}", text(&ambiguous));
    assert!(
        text(&ambiguous).contains(
            "consumer billing has dead letters with the message id m-1 from 2 sources \
             (/legacy, /shop): name one with --source"
        ),
        "{}",
        text(&ambiguous)
    );
    for (args, says) in [
        (
            &["inbox-dead-letters", "show", "billing", "m-9"][..],
            "consumer billing has no dead letter with the message id m-9",
        ),
        (
            &["inbox-dead-letters", "discard", "mailer", "m-1"][..],
            "consumer mailer has no dead letter with the message id m-1",
        ),
        (
            &[
                "inbox-dead-letters",
                "show",
                "mailer",
                "m-3",
                "--source",
                "/other",
            ][..],
            "consumer mailer has no dead letter with the message id m-3 from the source \"/other\"",
        ),
    ] {
        let output = outbox(&env, &nats, args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", text(&output));
        assert!(text(&output).contains(says), "{args:?}: {}", text(&output));
    }

    let discarded = outbox(
        &env,
        &nats,
        &[
            "inbox-dead-letters",
            "discard",
            "billing",
            "m-1",
            "--source",
            "/legacy",
        ],
    );
    assert!(
        text(&discarded).contains("discarded billing's dead letter m-1"),
        "{}",
        text(&discarded)
    );
    let discarded = outbox(
        &env,
        &nats,
        &["inbox-dead-letters", "discard", "mailer", "m-3"],
    );
    assert!(discarded.status.success(), "{}", text(&discarded));
    let left = lines(&outbox(
        &env,
        &nats,
        &["inbox-dead-letters", "list", "--json"],
    ));
    let left: Vec<_> = left
        .iter()
        .map(|l| format!("{} {} {}", l["consumer"], l["source"], l["message_id"]))
        .collect();
    assert_eq!(
        left,
        [r#""billing" "/shop" "m-1""#, r#""billing" "/shop" "m-2""#]
    );
    for args in [
        &["inbox-dead-letters", "discard", "billing"][..],
        &["inbox-dead-letters", "discard", "--all", "billing", "m-1"],
    ] {
        let output = outbox(&env, &nats, args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", text(&output));
    }
    let discarded = outbox(
        &env,
        &nats,
        &["inbox-dead-letters", "discard", "--all", "billing"],
    );
    assert!(
        text(&discarded).contains("discarded 2 dead letters of consumer billing"),
        "{}",
        text(&discarded)
    );
    let listed = outbox(&env, &nats, &["inbox-dead-letters", "list"]);
    assert_eq!(text(&listed).trim(), "no inbox dead letters");
    assert_eq!(
        left_inbox(&env).await,
        4,
        "the inbox still records every message"
    );
}

/// Text a row carries (an error a handler returned, an id or a type a hand insert wrote) is
/// shown on its line with its control characters and bidirectional overrides escaped: a line
/// break no longer splits a row of `dead-letters list`, `inbox-dead-letters list` or
/// `status`, `show`'s indented JSON escapes them as JSON does, and no escape sequence reaches
/// the operator's terminal. (Before: printed raw.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_text_keeps_its_line_and_cannot_drive_the_terminal() {
    let env = TestEnv::new().await;
    let nats = support::nats_url();
    env.conn()
        .await
        .batch_execute(&format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_seq, event_type, \
                 partition_key, subject, payload, dead_lettered_at, last_error) VALUES \
             ('Order', E'o-\\u202e1', 1, E'Placed\\x1b[8m', 'o-1', '{p}.Order.o-1.Placed', \
              '{{}}', now(), E'no route to host\\n  caused by: \\x1b[2Jtimeout\\u009b'); \
             INSERT INTO outbox_inbox_dead_letters (consumer, source, message_id, subject, \
                 headers, payload, error, deliveries, stream_sequence) VALUES \
             ('billing', '/shop', E'm-\\r1', 'app.Order.o-1.Placed', '{{}}', '', \
              E'handler failed:\\n\\tno account\\x07', 1, 41); \
             INSERT INTO outbox_inbox (consumer, source, message_id, handled_at) VALUES \
             (E'bill\\x1b[2Jing', '/shop', 'm-9', now() - interval '1 hour')",
            p = env.prefix
        ))
        .await
        .unwrap();

    let shown = |args: &[&str]| {
        let output = outbox(&env, &nats, args);
        assert!(output.status.success(), "{args:?}: {}", text(&output));
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert!(
            !stdout.contains(['\u{1b}', '\u{7}', '\r', '\t', '\u{9b}', '\u{202e}']),
            "{args:?} printed a control or bidi character: {stdout:?}"
        );
        stdout
    };
    let letters = shown(&["dead-letters", "list"]);
    assert_eq!(letters.lines().count(), 1, "{letters}");
    assert!(
        letters.contains(
            "Order o-\\u{202e}1 #1  Placed\\u{1b}[8m  attempts 0  blocks 0 events  \
             no route to host\\n  caused by: \\u{1b}[2Jtimeout\\u{9b}"
        ),
        "{letters}"
    );
    let inbox = shown(&["inbox-dead-letters", "list"]);
    assert_eq!(inbox.lines().count(), 1, "{inbox}");
    assert!(
        inbox.contains(
            "billing  m-\\r1  app.Order.o-1.Placed  deliveries 1  \
             handler failed:\\n\\tno account\\u{7}"
        ),
        "{inbox}"
    );
    let status = shown(&["status"]);
    let row = status
        .lines()
        .find(|line| line.starts_with("Order "))
        .unwrap_or_else(|| panic!("no row of Order: {status}"));
    assert_eq!(
        row.split_whitespace().collect::<Vec<_>>(),
        ["Order", "Placed\\u{1b}[8m", "0", "1"],
        "{status}"
    );
    // The JSON forms keep the text whole (JSON escapes its control characters itself).
    let json = outbox(&env, &nats, &["dead-letters", "list", "--json"]);
    let letter: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let error = "no route to host\n  caused by: \u{1b}[2Jtimeout\u{9b}";
    assert_eq!(letter["last_error"], error);
    // `show` for a reader: indented JSON whose escapes cover what serde_json leaves raw (the
    // C1 control, the bidi override); the same values as `--json`.
    let id = letter["id"].as_str().unwrap();
    let whole = shown(&["dead-letters", "show", id]);
    assert!(whole.contains(r#""aggregate_id": "o-\u202e1""#), "{whole}");
    let read: serde_json::Value = serde_json::from_str(&whole).unwrap();
    assert_eq!(read["last_error"], error);
    let exact = outbox(&env, &nats, &["dead-letters", "show", id, "--json"]);
    assert_eq!(
        read,
        serde_json::from_slice::<serde_json::Value>(&exact.stdout).unwrap()
    );

    // A consumer's name in the inbox's rows, as `purge` reports its progress and its count.
    let purged = outbox(&env, &nats, &["purge", "--older-than", "2m"]);
    let said = text(&purged);
    assert!(purged.status.success(), "{said}");
    assert!(
        !said.contains(['\u{1b}', '\u{9b}']),
        "purge printed a control character: {said:?}"
    );
    assert!(
        said.contains("deleted 1 inbox rows of bill\\u{1b}[2Jing"),
        "{said}"
    );
    // A message's source (its `ce-source`, as its publisher wrote it), in the error that
    // lists the sources a message id was dead-lettered under.
    env.conn()
        .await
        .batch_execute(
            "INSERT INTO outbox_inbox_dead_letters (consumer, source, message_id, subject, \
                 headers, payload, error, deliveries, stream_sequence) VALUES \
             ('billing', E'/shop\\x1b[2J\\u202e', 'm-2', 'app.Order.o-2.Placed', '{}', '', \
              'failed', 1, 42), \
             ('billing', '/legacy', 'm-2', 'app.Order.o-2.Placed', '{}', '', 'failed', 1, 43)",
        )
        .await
        .unwrap();
    let ambiguous = refused(
        &env,
        &nats,
        &["inbox-dead-letters", "show", "billing", "m-2"],
    );
    let said = text(&ambiguous);
    assert_eq!(ambiguous.status.code(), Some(2), "{said}");
    assert!(
        !said.contains(['\u{1b}', '\u{202e}']),
        "the error printed a control or bidi character: {said:?}"
    );
    assert!(
        said.contains("from 2 sources (/legacy, /shop\\u{1b}[2J\\u{202e}): name one with --source"),
        "{said}"
    );
}

/// The rows of `outbox_inbox` in `env`'s database.
async fn left_inbox(env: &TestEnv) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    use diesel_async::RunQueryDsl;
    let count: Count = diesel::sql_query("SELECT count(*) AS n FROM outbox_inbox")
        .get_result(&mut env.conn().await)
        .await
        .unwrap();
    count.n
}

#[tokio::test]
async fn purge_deletes_old_published_and_inbox_rows_and_leaves_the_queue_alone() {
    let env = TestEnv::new().await;
    insert(
        &env,
        "o-1",
        1,
        "Placed",
        "now() - interval '3 days', NULL, NULL, now() - interval '3 days', NULL",
    )
    .await;
    insert(&env, "o-1", 2, "Shipped", "now(), NULL, NULL, now(), NULL").await;
    insert(
        &env,
        "o-2",
        1,
        "Placed",
        "now() - interval '3 days', NULL, NULL, NULL, NULL",
    )
    .await;
    insert(&env, "o-3", 1, "Placed", DEAD).await;
    env.conn()
        .await
        .batch_execute(
            "INSERT INTO outbox_inbox (consumer, source, message_id, handled_at) VALUES \
             ('a', '/s', 'old', now() - interval '3 days'), ('a', '/s', 'new', now()), \
             ('b', '/s', 'old', now() - interval '3 days'); \
             CREATE TABLE outbox_published_p20200101 PARTITION OF outbox_published \
               FOR VALUES FROM ('2020-01-01 00:00Z') TO ('2020-01-02 00:00Z'); \
             INSERT INTO outbox_published VALUES (gen_random_uuid(), 'A', 'a', 1, 'Placed', 1, \
               'a', 'x.A', '{}', '{}', now(), NULL, NULL, 0, '2020-01-01 12:00Z'), \
               (gen_random_uuid(), 'A', 'a', 2, 'Placed', 1, 'a', 'x.A', '{}', '{}', now(), \
               NULL, NULL, 0, now())",
        )
        .await
        .unwrap();
    // A batch of no rows is refused, naming the flag (it was taken as 1, silently); nothing is
    // deleted, as the counts below show.
    for batch in ["0", "-5"] {
        let refused = refused(
            &env,
            &support::nats_url(),
            &["purge", "--older-than", "1d", "--batch", batch],
        );
        assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
        assert!(
            text(&refused).contains(&format!("invalid value '{batch}' for '--batch <BATCH>'")),
            "{}",
            text(&refused)
        );
    }
    let purged = outbox(
        &env,
        &support::nats_url(),
        &["purge", "--older-than", "1d", "--batch", "1"],
    );
    assert!(purged.status.success(), "{}", text(&purged));
    let shown = text(&purged);
    assert!(
        shown.contains("deleted 1 published rows older than 1day"),
        "{shown}"
    );
    assert!(shown.contains("deleted 1 inbox rows of a"), "{shown}");
    assert!(shown.contains("deleted 1 inbox rows of b"), "{shown}");
    assert!(
        shown.contains("dropped archive partition outbox_published_p20200101"),
        "{shown}"
    );
    assert_eq!(
        left(&env).await,
        ["a:new", "archived 2", "o-1#2", "o-2#1", "o-3#1"]
    );
    // Again, with nothing old left: the counts, and no progress line for a purge of one
    // batch (it said "outbox_inbox a: 0 rows deleted" before "deleted 0 inbox rows of a").
    let again = outbox(
        &env,
        &support::nats_url(),
        &["purge", "--older-than", "1d", "--batch", "1"],
    );
    let shown = text(&again);
    assert!(again.status.success(), "{shown}");
    assert!(shown.contains("deleted 0 inbox rows of a"), "{shown}");
    assert!(!shown.contains("rows deleted"), "{shown}");
}

/// A purge younger than a message's redeliveries would take the inbox's ids that a
/// duplicate may still meet: it is refused before anything is deleted, naming the flag, the
/// floor and `--no-inbox`; with `--no-inbox` the same age purges the outbox alone.
#[tokio::test]
async fn purge_refuses_to_take_inbox_ids_a_redelivery_may_still_need() {
    let env = TestEnv::new().await;
    insert(
        &env,
        "o-1",
        1,
        "Placed",
        "now() - interval '50 seconds', NULL, NULL, now() - interval '50 seconds', NULL",
    )
    .await;
    env.conn()
        .await
        .batch_execute(
            "INSERT INTO outbox_inbox (consumer, source, message_id, handled_at) VALUES \
             ('a', '/s', 'recent', now() - interval '50 seconds')",
        )
        .await
        .unwrap();
    for age in ["0s", "30s", "65s"] {
        let refused = refused(&env, &support::nats_url(), &["purge", "--older-than", age]);
        assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
        let said = text(&refused);
        assert!(said.contains("would purge inbox rows"), "{said}");
        assert!(said.contains("--older-than 1m 6s or more"), "{said}");
        assert!(said.contains("--no-inbox"), "{said}");
        assert!(said.contains("nothing was deleted"), "{said}");
        assert_eq!(
            left(&env).await,
            ["a:recent", "o-1#1"],
            "after --older-than {age}"
        );
    }
    let purged = outbox(
        &env,
        &support::nats_url(),
        &["purge", "--older-than", "30s", "--no-inbox"],
    );
    assert!(purged.status.success(), "{}", text(&purged));
    assert_eq!(left(&env).await, ["a:recent"]);
}

/// The outbox's rows (`aggregate_id#aggregate_seq`), the inbox's (`consumer:message_id`)
/// and the archive's (`archived aggregate_seq`) in `env`'s database, sorted.
async fn left(env: &TestEnv) -> Vec<String> {
    #[derive(diesel::QueryableByName)]
    struct Left {
        #[diesel(sql_type = diesel::sql_types::Text)]
        what: String,
    }
    use diesel_async::RunQueryDsl;
    let left: Vec<Left> = diesel::sql_query(
        "SELECT aggregate_id || '#' || aggregate_seq AS what FROM outbox_events \
         UNION ALL SELECT consumer || ':' || message_id FROM outbox_inbox \
         UNION ALL SELECT 'archived ' || aggregate_seq FROM outbox_published ORDER BY 1",
    )
    .load(&mut env.conn().await)
    .await
    .unwrap();
    left.into_iter().map(|l| l.what).collect()
}

/// Intervals that would run a loop without a pause (an idle relay claiming, a purge opening
/// connections), more workers than a relay runs (each a connection of the database's), a
/// first retry delay over its cap and a stream name JetStream refuses are refused before
/// anything is connected, naming the setting: with NATS up, and with NATS unreachable
/// (where the NATS error came first and hid the setting at fault).
#[tokio::test]
async fn the_relay_refuses_settings_it_cannot_honour_naming_them() {
    let env = TestEnv::new().await;
    for (flags, says) in [
        (
            &["--poll-interval", "0s"][..],
            "poll_interval must be at least 1ms, not 0ns",
        ),
        (
            &["--max-backoff", "500us"][..],
            "max_backoff must be at least 1ms, not 500µs",
        ),
        (
            &["--purge-older-than", "1d", "--purge-interval", "0s"][..],
            "--purge-interval must be at least 1s, not 0s",
        ),
        (
            &["--workers", "2000"][..],
            "workers 2000 is more than a relay runs (64)",
        ),
        (
            &["--retry-delay", "10m"][..],
            "retry_delay 600s is longer than max_retry_delay 300s",
        ),
        (
            &["--stream", "ORDERS AND MORE"][..],
            "topology.stream.name \"ORDERS AND MORE\" is not a JetStream stream name",
        ),
        (
            &["--jetstream-domain", "hub.east"][..],
            "topology.stream.domain \"hub.east\" is not a JetStream domain: it contains '.'",
        ),
    ] {
        let mut args = vec!["relay", "--subject-prefix", &env.prefix];
        if !flags.contains(&"--stream") {
            args.extend(["--stream", &env.stream]);
        }
        args.extend_from_slice(flags);
        refused_before_connecting(&env, &args, &[says]);
    }
}

/// A `RUST_LOG` that is not a log filter is refused, naming the variable, its value and the
/// fault, before the relay connects anything: it fell back to `info` without a word, so an
/// operator who asked for `outbox_runtime=degub` saw less than they asked for and no reason.
/// An empty one is the default, `info`, and a filter is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_refuses_a_log_filter_it_cannot_parse_naming_it() {
    let env = TestEnv::new().await;
    for (filter, fault) in [
        ("outbox_runtime=degub", "error parsing level filter"),
        ("=info", "invalid filter directive"),
        ("[{", "invalid filter directive"),
    ] {
        for nats_url in [support::nats_url(), "nats://127.0.0.1:1".to_owned()] {
            let refused = refused_as(
                relay_command(&env, &nats_url).env("RUST_LOG", filter),
                &format!("RUST_LOG={filter} was taken"),
            );
            let output = text(&refused);
            assert_eq!(refused.status.code(), Some(2), "{filter}: {output}");
            let says = format!("RUST_LOG={filter:?} is not a log filter: {fault}");
            assert!(output.contains(&says), "{says:?} not said: {output}");
        }
    }
    for (filter, logs_info) in [("", true), ("warn", false)] {
        let relay = relay_command(&env, &support::nats_url())
            .env("RUST_LOG", filter)
            .spawn()
            .expect("run outbox");
        let mut order = support::domain::Order::place(&format!("o-{filter}"), "ada", 1);
        env.commit(&mut order).await;
        env.until_stream_holds(if logs_info { 1 } else { 2 }, Duration::from_secs(20))
            .await;
        let (output, _, code) = stop(relay).await;
        assert_eq!(code, Some(0), "RUST_LOG={filter:?}: {output}");
        assert_eq!(
            output.contains(" INFO ") && output.contains("relaying"),
            logs_info,
            "RUST_LOG={filter:?}: {output}"
        );
    }
}

/// Runs each command that opens the database with `DATABASE_URL` set to `url`: each must
/// refuse it (exit 2) saying `says`, and never say `never` (a password in the URL, say).
fn refused_by_each_database_command(env: &TestEnv, url: &str, says: &str, never: &str) {
    let commands: [&[&str]; 6] = [
        &["migrate"],
        &["status"],
        &["relay"],
        &["dead-letters", "list"],
        &["purge", "--older-than", "7d"],
        &["replay", "--to-prefix", "replay", "--to-stream", "REPLAY"],
    ];
    for args in commands {
        let refused = refused_as(
            command(env, &support::nats_url())
                .env("DATABASE_URL", url)
                .args(args),
            &format!("{args:?} took the URL {url:?}"),
        );
        let output = text(&refused);
        assert_eq!(refused.status.code(), Some(2), "{url:?} {args:?}: {output}");
        assert!(output.contains(says), "{url:?} {args:?}: {output}");
        assert!(!output.contains(never), "{url:?} {args:?}: {output}");
    }
}

/// A `DATABASE_URL` whose scheme names no database (a typo: `postgress://`) is refused by
/// each command that opens the database, naming the scheme and the ones there are, where it
/// was taken for a SQLite file's path ("build it with `--features sqlite`"; with that
/// feature, a file to open); the password in it is not shown.
#[tokio::test]
async fn a_database_url_of_no_known_scheme_is_refused_by_each_command() {
    let env = TestEnv::new().await;
    refused_by_each_database_command(
        &env,
        "postgress://app:s3cret@127.0.0.1/orders",
        "DATABASE_URL: a postgress:// URL names no database the outbox runs on",
        "s3cret",
    );
}

/// An empty `DATABASE_URL` (a variable set to nothing, or blanks) is refused as empty by each
/// command that needs the database, where it was taken for a SQLite file's path: "postgres://
/// names a database this build of outbox does not know: build it with `--features mysql` or
/// `--features sqlite`".
#[tokio::test]
async fn an_empty_database_url_is_refused_as_empty_by_each_command() {
    let env = TestEnv::new().await;
    for url in ["", "  "] {
        refused_by_each_database_command(
            &env,
            url,
            "DATABASE_URL: the database URL is empty",
            "this build of outbox does not know",
        );
    }
}

/// A SQLite URL without a path (`sqlite://`, the path's variable set to nothing) is refused by
/// each command, naming it, where `outbox migrate` applied the migrations to the temporary
/// database SQLite opens for an empty path (and reported them applied), and a build without
/// SQLite said to build it with `--features sqlite`.
#[tokio::test]
async fn a_sqlite_url_without_a_path_is_refused_by_each_command() {
    let env = TestEnv::new().await;
    for url in ["sqlite://", "file:?mode=rwc"] {
        refused_by_each_database_command(
            &env,
            url,
            &format!("DATABASE_URL: the SQLite URL {url:?} names no file"),
            "this build of outbox does not know",
        );
    }
}

/// An in-memory SQLite database (`:memory:`, a `file:` URI of it or with `mode=memory`) is
/// refused by each command that opens the database: it would live in the command's own
/// connection, where no other process sees it. Before, it was taken for a file this build
/// does not open ("this build of outbox does not know"), and with `--features sqlite`
/// `outbox migrate` applied the migrations to it and reported them applied.
#[tokio::test]
async fn an_in_memory_sqlite_database_is_refused_by_each_command() {
    let env = TestEnv::new().await;
    for url in [
        ":memory:",
        "sqlite://:memory:",
        "file::memory:?cache=shared",
        "file:orders?mode=memory&cache=shared",
    ] {
        refused_by_each_database_command(
            &env,
            url,
            &format!("DATABASE_URL: the SQLite database {url:?} is in memory"),
            "this build of outbox does not know",
        );
    }
}

/// `outbox tail --subject` takes a NATS subject filter, and says what is wrong with one that
/// is not, before it connects: JetStream's answer named no fault ("consumer filter subject is
/// not a valid subset of the interest subjects"), and an empty filter followed every subject.
#[tokio::test]
async fn tail_refuses_a_subject_that_is_not_a_filter_naming_its_fault() {
    let env = TestEnv::new().await;
    for (subject, says) in [
        ("events..Placed", "token 2 (\"\"): it is empty"),
        ("", "token 1 (\"\"): it is empty"),
        (
            "events.>.Placed",
            "token 2 is '>', which stands only as the last token",
        ),
    ] {
        let args = ["tail", "--stream", &env.stream, "--subject", subject];
        let fault = format!("--subject: subject filter {subject:?} is not valid");
        refused_before_connecting(&env, &args, &[&fault, says]);
    }
}

/// `outbox tail --stream` with a name JetStream would read as something else (its API subject
/// `$JS.API.STREAM.INFO.<name>` split in two by a space or a `.`) is refused before
/// connecting, naming the stream and its fault, whether NATS is up or not.
#[tokio::test]
async fn tail_refuses_a_stream_that_is_not_a_stream_name_naming_its_fault() {
    let env = TestEnv::new().await;
    for (stream, says) in [
        ("ORDERS AND MORE", "it contains whitespace"),
        ("ORDERS.V2", "'.'"),
        ("ORDERS/V2", "the path separator '/'"),
        ("", "it is empty"),
    ] {
        let fault = format!("--stream: {stream:?} is not a JetStream stream name");
        refused_before_connecting(&env, &["tail", "--stream", stream], &[&fault, says]);
    }
}

/// `outbox tail --count 0` is refused before connecting: it connected, followed the stream
/// and printed nothing, which reads as an empty stream.
#[tokio::test]
async fn tail_refuses_a_count_of_zero() {
    let env = TestEnv::new().await;
    refused_before_connecting(
        &env,
        &["tail", "--stream", &env.stream, "--count", "0"],
        &["invalid value '0' for '--count <COUNT>'", "0 is not in 1.."],
    );
}

/// `outbox tail` of a stream that does not exist yet (no relay has started) says so and how
/// it comes to exist, rather than JetStream's "stream not found (code 404, error code 10059)".
#[tokio::test]
async fn tail_of_a_stream_no_relay_created_yet_says_who_creates_it() {
    let env = TestEnv::new().await;
    let refused = refused(
        &env,
        &support::nats_url(),
        &["tail", "--stream", &env.stream],
    );
    let output = text(&refused);
    assert!(!refused.status.success(), "{output}");
    assert!(
        output.contains(&format!(
            "no stream {:?} on this NATS server: a relay creates it when it starts",
            env.stream
        )),
        "{output}"
    );
}

/// Against a nats-server without JetStream (started without `-js`), `outbox relay` and
/// `outbox tail` say so and how to start one, where async-nats's words ("requested JetStream
/// resource does not exist") read as a missing stream.
#[tokio::test]
async fn the_relay_and_tail_name_a_nats_server_without_jetstream() {
    let env = TestEnv::new().await;
    let server = NatsServer::start_without_jetstream().await;
    let relay = [
        "relay",
        "--subject-prefix",
        &env.prefix,
        "--stream",
        &env.stream,
    ];
    for args in [&relay[..], &["tail", "--stream", &env.stream]] {
        let refused = refused(&env, &server.url(), args);
        let output = text(&refused);
        assert!(!refused.status.success(), "{args:?}: {output}");
        assert!(
            output.contains(&format!("{:?}", env.stream))
                && output.contains(outbox_runtime::nats::NO_JETSTREAM),
            "{args:?}: {output}"
        );
    }
}

/// `outbox tail --jetstream-domain` with a domain that is not one subject token (it would
/// split JetStream's API subject `$JS.<domain>.API`) is refused before connecting, naming it.
#[tokio::test]
async fn tail_refuses_a_jetstream_domain_that_is_not_one_token_naming_it() {
    let env = TestEnv::new().await;
    refused_before_connecting(
        &env,
        &[
            "tail",
            "--stream",
            &env.stream,
            "--jetstream-domain",
            "hub east",
        ],
        &["--jetstream-domain \"hub east\" is not a JetStream domain: it contains whitespace"],
    );
}

/// `outbox relay` and `outbox tail` given a JetStream domain that no server they reach runs
/// (misspelt, or a leaf node's hub unreachable) name the domain and its API's subjects, where
/// the words of a server without JetStream would send the operator to its `-js` flag.
#[tokio::test]
async fn the_relay_and_tail_name_a_jetstream_domain_nothing_answers() {
    let env = TestEnv::new().await;
    let relay = [
        "relay",
        "--subject-prefix",
        &env.prefix,
        "--stream",
        &env.stream,
        "--jetstream-domain",
        "nowhere",
    ];
    let tail = [
        "tail",
        "--stream",
        &env.stream,
        "--jetstream-domain",
        "nowhere",
    ];
    for args in [&relay[..], &tail[..]] {
        let refused = refused(&env, &support::nats_url(), args);
        let output = text(&refused);
        assert!(!refused.status.success(), "{args:?}: {output}");
        assert!(
            output.contains(
                "nothing answers the API of JetStream domain \"nowhere\" ($JS.nowhere.API.>) \
                 at this NATS server: no server it reaches runs JetStream in that domain"
            ) && !output.contains(outbox_runtime::nats::NO_JETSTREAM),
            "{args:?}: {output}"
        );
    }
}

/// `outbox relay` for `env`, its output piped.
fn relay_command(env: &TestEnv, nats_url: &str) -> Command {
    let mut command = command(env, nats_url);
    command
        .args([
            "relay",
            "--subject-prefix",
            &env.prefix,
            "--stream",
            &env.stream,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Starts `outbox relay` for `env`, with `extra` arguments.
fn start_relay(env: &TestEnv, nats_url: &str, extra: &[&str]) -> std::process::Child {
    relay_command(env, nats_url)
        .args(["--poll-interval", "50ms", "--stats-interval", "200ms"])
        .args(extra)
        .spawn()
        .expect("start outbox relay")
}

/// Stops a relay with SIGTERM; returns its output, how long it took, and its exit code.
async fn stop(child: std::process::Child) -> (String, Duration, Option<i32>) {
    support::signal(child.id(), "TERM");
    let started = Instant::now();
    let output = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    (text(&output), started.elapsed(), output.status.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_daemon_publishes_serves_metrics_and_stops_on_sigterm() {
    let env = TestEnv::new().await;
    let port = support::free_port();
    let address = format!("127.0.0.1:{port}");
    let relay = start_relay(&env, &support::nats_url(), &["--metrics-addr", &address]);
    for n in 0..3 {
        let mut order = support::domain::Order::place(&format!("o-{n}"), "ada", 1);
        order.record(support::domain::OrderEvent::Shipped);
        env.commit(&mut order).await;
    }
    env.until_stream_holds(6, Duration::from_secs(20)).await;

    let scraped = scraped_once_drained(&address, 6.0).await;
    let value = |line_start: &str| -> f64 {
        scraped
            .lines()
            .find(|line| line.starts_with(line_start))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{line_start} in\n{scraped}"))
    };
    assert_eq!(
        value("outbox_relay_published_total{event_type=\"Placed\"}"),
        3.0
    );
    assert_eq!(
        value("outbox_relay_published_total{event_type=\"Shipped\"}"),
        3.0
    );
    assert_eq!(value("outbox_dead_letters "), 0.0);
    assert_eq!(value("outbox_relay_publish_delay_seconds_count"), 6.0);
    assert!(scraped.contains("# HELP outbox_oldest_queued_age_seconds"));
    let status = outbox(&env, &support::nats_url(), &["status", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        report["queued"].as_f64(),
        Some(value("outbox_queued_events "))
    );

    let (output, took, code) = stop(relay).await;
    assert_eq!(code, Some(0), "{output}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(
        output.contains("stopping gracefully") && output.contains("stopped"),
        "{output}"
    );
}

/// A relay whose worker panics (a bug, here a crash point set to panic before its first
/// publish, through `FAILPOINTS`: the test build compiles the runtime's crash points in) stops
/// by itself; the daemon must then exit, with an error that says so, rather than stay up with
/// the outbox filling and nothing published; its event stays queued for the next relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_daemon_exits_when_its_relay_stops_by_itself() {
    let env = TestEnv::new().await;
    let child = relay_command(&env, &support::nats_url())
        .env(
            "FAILPOINTS",
            "relay::before_publish=panic(a bug in a worker)",
        )
        .spawn()
        .expect("start outbox relay");
    let mut order = support::domain::Order::place("o-1", "ada", 1);
    env.commit(&mut order).await;

    let output = exited_within_30_s(child, "the daemon still ran 30 s after its relay stopped");
    let said = text(&output);
    assert_eq!(output.status.code(), Some(2), "{said}");
    assert!(
        said.contains("outbox: the relay stopped by itself: relay task did not finish")
            && said.contains("a bug in a worker"),
        "{said}"
    );
    let stats = outbox_runtime::outbox::stats(&mut env.conn().await)
        .await
        .unwrap();
    assert_eq!(stats.queued, 1, "the event stays queued for the next relay");
}

/// The body of an HTTP GET, by hand: the endpoint speaks plain HTTP/1.1.
/// The metrics the relay at `address` serves, once its gauges say the outbox is drained
/// (`outbox_queued_events 0`) and its counters have counted `published` events (a batch's
/// acks reach the stream before its commit, and the counters count after it); within 10 s.
async fn scraped_once_drained(address: &str, published: f64) -> String {
    let url = format!("http://{address}/metrics");
    wait_until("the gauges and counters", Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            let body = tokio::task::spawn_blocking(move || scrape(&url))
                .await
                .ok()??;
            let counted: f64 = body
                .lines()
                .filter(|line| line.starts_with("outbox_relay_published_total{"))
                .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            (body.contains("outbox_queued_events 0") && counted == published).then_some(body)
        }
    })
    .await
}

fn scrape(url: &str) -> Option<String> {
    use std::io::{Read, Write};
    let address = url.strip_prefix("http://")?.split('/').next()?;
    let mut stream = std::net::TcpStream::connect(address).ok()?;
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {address}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// Commits one event and waits until `relay` (a running `outbox relay`) published it.
async fn relays_through(env: &TestEnv, relay: std::process::Child) -> (String, Option<i32>) {
    let mut order = support::domain::Order::place("o-1", "ada", 1);
    env.commit(&mut order).await;
    env.until_stream_holds(1, Duration::from_secs(20)).await;
    let (output, _, code) = stop(relay).await;
    (output, code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_authenticates_with_each_kind_of_credential_and_fails_clearly_without() {
    const PASSWORD: &str = "pw-s3cret-1";
    const TOKEN: &str = "tok-s3cret-2";
    let key = nkeys::KeyPair::new_user();
    let seed = key.seed().unwrap();

    // A user and password.
    let server = NatsServer::start_with(&["--user", "relay", "--pass", PASSWORD]).await;
    let env = TestEnv::with_nats(&format!(
        "nats://relay:{PASSWORD}@127.0.0.1:{}",
        server.port
    ))
    .await;
    let relay = start_relay(
        &env,
        &server.url(),
        &["--nats-user", "relay", "--nats-password", PASSWORD],
    );
    let (output, code) = relays_through(&env, relay).await;
    assert_eq!(code, Some(0), "{output}");
    assert!(!output.contains(PASSWORD), "{output}");
    let wrong = outbox(
        &env,
        &server.url(),
        &[
            "relay",
            "--subject-prefix",
            &env.prefix,
            "--stream",
            &env.stream,
            "--nats-user",
            "relay",
            "--nats-password",
            "wrong-s3cret",
        ],
    );
    assert_eq!(wrong.status.code(), Some(2));
    let shown = text(&wrong);
    assert!(shown.contains("authorization violation"), "{shown}");
    assert!(!shown.contains("s3cret"), "{shown}");
    drop((env, server));

    // A token, in the URL.
    let server = NatsServer::start_with(&["--auth", TOKEN]).await;
    let url = format!("nats://{TOKEN}@127.0.0.1:{}", server.port);
    let env = TestEnv::with_nats(&url).await;
    let (output, code) = relays_through(&env, start_relay(&env, &url, &[])).await;
    assert_eq!(code, Some(0), "{output}");
    assert!(!output.contains(TOKEN), "{output}");
    drop((env, server));

    // An NKey.
    let server = NatsServer::start_with_config(&format!(
        "authorization {{ users = [ {{ nkey: {} }} ] }}\n",
        key.public_key()
    ))
    .await;
    let settings = outbox_runtime::nats::NatsSettings {
        nkey_seed: Some(seed.clone()),
        ..outbox_runtime::nats::NatsSettings::new(server.url())
    };
    let client = settings.connect().await.unwrap();
    let env = TestEnv::with_client(client, &server.url()).await;
    let relay = start_relay(&env, &server.url(), &["--nats-nkey-seed", &seed]);
    let (output, code) = relays_through(&env, relay).await;
    assert_eq!(code, Some(0), "{output}");
    assert!(!output.contains(&seed), "{output}");
    let none = outbox(
        &env,
        &server.url(),
        &["tail", "--stream", &env.stream, "--count", "1"],
    );
    assert_eq!(
        none.status.code(),
        Some(2),
        "no credentials: {}",
        text(&none)
    );
    assert!(
        text(&none).contains("authorization violation"),
        "{}",
        text(&none)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_prints_each_event_with_its_subject_sequence_and_type() {
    let env = TestEnv::new().await;
    let mut order = support::domain::Order::place("o-1", "ada", 1);
    order.record(support::domain::OrderEvent::Shipped);
    env.commit(&mut order).await;
    let mut relay = outbox_runtime::Relay::connect(env.relay_config(), env.nats.clone())
        .await
        .unwrap();
    while relay.relay_batch().await.unwrap().claimed > 0 {}
    // Another producer's message, whose text would break the line and drive the terminal:
    // shown on one line, escaped.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("ce-type", "Plac\u{202e}ed");
    async_nats::jetstream::new(env.nats.clone())
        .publish_with_headers(
            format!("{}.Order.o-2\u{1b}[8m.Placed", env.prefix),
            headers,
            "line one\nline two\u{1b}[2J".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let tailed = outbox(
        &env,
        &support::nats_url(),
        &["tail", "--stream", &env.stream, "--all", "--count", "3"],
    );
    assert!(tailed.status.success(), "{}", text(&tailed));
    let lines: Vec<String> = String::from_utf8_lossy(&tailed.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(
        lines,
        [
            format!(
                "{}.Order.o-1.Placed  #1  Placed v1  {{\"customer\":\"ada\",\"total_cents\":1}}",
                env.prefix
            ),
            format!("{}.Order.o-1.Shipped  #2  Shipped v1  {{}}", env.prefix),
            format!(
                "{}.Order.o-2\\u{{1b}}[8m.Placed  #3  Plac\\u{{202e}}ed v-  \
                 line one\\nline two\\u{{1b}}[2J",
                env.prefix
            ),
        ]
    );
}

/// A directory of files a test writes (certificates, keys, server configs), removed after.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("outbox-cli-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn write(&self, name: &str, contents: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path.to_str().unwrap().to_owned()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_connects_over_mutual_tls_with_a_private_ca() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let scratch = Scratch::new();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let ca = Issuer::new(ca_params, ca_key);
    let signed = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = signed(vec!["127.0.0.1".into(), "localhost".into()]);
    let (client_cert, client_key) = signed(vec!["relay".into()]);
    let ca_file = scratch.write("ca.pem", &ca_cert.pem());
    let server_cert = scratch.write("server.pem", &server_cert);
    let server_key = scratch.write("server.key", &server_key);
    let client_cert = scratch.write("client.pem", &client_cert);
    let client_key = scratch.write("client.key", &client_key);
    let server = NatsServer::start_with(&[
        "--tls",
        "--tlscert",
        &server_cert,
        "--tlskey",
        &server_key,
        "--tlsverify",
        "--tlscacert",
        &ca_file,
    ])
    .await;

    let settings = outbox_runtime::nats::NatsSettings {
        ca_file: Some(ca_file.clone().into()),
        client_cert: Some(client_cert.clone().into()),
        client_key: Some(client_key.clone().into()),
        ..outbox_runtime::nats::NatsSettings::new(server.url())
    };
    let env = TestEnv::with_client(settings.connect().await.unwrap(), &server.url()).await;
    let relay = start_relay(
        &env,
        &server.url(),
        &[
            "--nats-ca",
            &ca_file,
            "--nats-client-cert",
            &client_cert,
            "--nats-client-key",
            &client_key,
        ],
    );
    let (output, code) = relays_through(&env, relay).await;
    assert_eq!(code, Some(0), "{output}");

    // Without the client certificate the server refuses the handshake.
    let refused = outbox(
        &env,
        &server.url(),
        &[
            "tail",
            "--stream",
            &env.stream,
            "--nats-ca",
            &ca_file,
            "--count",
            "1",
        ],
    );
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(
        text(&refused).contains("cannot connect to NATS"),
        "{}",
        text(&refused)
    );
}

/// A NATS JWT (header, claims, ed25519 signature by `signer`: NATS's JWT format, as `nsc`
/// writes it).
fn jwt(claims: serde_json::Value, signer: &nkeys::KeyPair) -> String {
    use data_encoding::BASE64URL_NOPAD;
    let header = BASE64URL_NOPAD.encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let payload = BASE64URL_NOPAD.encode(claims.to_string().as_bytes());
    let signed = format!("{header}.{payload}");
    let signature = signer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", BASE64URL_NOPAD.encode(&signature))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_authenticates_with_a_credentials_file() {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let account_jwt = jwt(
        serde_json::json!({
            "jti": uuid::Uuid::new_v4().simple().to_string(),
            "iat": now,
            "iss": operator.public_key(),
            "sub": account.public_key(),
            "name": "outbox",
            "nats": {
                "limits": {
                    "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                    "wildcards": true, "conn": -1, "leaf": -1,
                    "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1
                },
                "type": "account",
                "version": 2
            }
        }),
        &operator,
    );
    let user_jwt = jwt(
        serde_json::json!({
            "jti": uuid::Uuid::new_v4().simple().to_string(),
            "iat": now,
            "iss": account.public_key(),
            "sub": user.public_key(),
            "name": "relay",
            "nats": {
                "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
                "type": "user", "version": 2
            }
        }),
        &account,
    );
    let seed = user.seed().unwrap();
    let scratch = Scratch::new();
    let creds = scratch.write(
        "relay.creds",
        &format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        ),
    );
    // JetStream in operator mode needs a system account.
    let system = nkeys::KeyPair::new_account();
    let system_jwt = jwt(
        serde_json::json!({
            "jti": uuid::Uuid::new_v4().simple().to_string(),
            "iat": now,
            "iss": operator.public_key(),
            "sub": system.public_key(),
            "name": "SYS",
            "nats": {"limits": {"subs": -1, "conn": -1}, "type": "account", "version": 2}
        }),
        &operator,
    );
    let config = scratch.write(
        "server.conf",
        &format!(
            "trusted_keys: [\"{operator}\"]\nsystem_account: {system}\nresolver: MEMORY\n\
             resolver_preload: {{\n  {account}: \"{account_jwt}\"\n  {system}: \"{system_jwt}\"\n}}\n",
            operator = operator.public_key(),
            system = system.public_key(),
            account = account.public_key(),
        ),
    );
    let server = NatsServer::start_with(&["--config", &config]).await;
    let settings = outbox_runtime::nats::NatsSettings {
        credentials_file: Some(creds.clone().into()),
        ..outbox_runtime::nats::NatsSettings::new(server.url())
    };
    let env = TestEnv::with_client(settings.connect().await.unwrap(), &server.url()).await;
    let relay = start_relay(&env, &server.url(), &["--nats-creds", &creds]);
    let (output, code) = relays_through(&env, relay).await;
    assert_eq!(code, Some(0), "{output}");
    assert!(!output.contains(&seed), "{output}");
}

/// A MySQL URL reads as diesel's own `MysqlConnection` (libmysqlclient) reads it, on a
/// MariaDB of the test's own: diesel's `unix_socket` is the server's socket (the URL's port,
/// closed, never tried), as is `MYSQL_UNIX_PORT` for `localhost`; a URL without a port or a
/// password takes `MYSQL_TCP_PORT` and `MYSQL_PWD`; one without a host or a user is
/// `localhost` and the operating system's user, and the error says what it took. Before,
/// mysql_async refused `unix_socket` ("Unknown connection URL parameter") and
/// `mysql:///orders` ("Invalid or incomplete connection URL"), read no variable, and logged
/// in as the user `''`.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mysql_url_reads_as_diesels_mysql_connection_reads_it() {
    let server = support::mariadb::MariadbServer::start().await;
    let password = format!("pw-{}", uuid::Uuid::new_v4().simple());
    outbox_runtime::mysql::establish(&server.url("mysql"))
        .await
        .unwrap()
        .batch_execute(&format!(
            "CREATE DATABASE orders; \
             CREATE USER app@'%' IDENTIFIED BY '{password}'; \
             GRANT ALL ON orders.* TO app@'%'"
        ))
        .await
        .unwrap();
    let socket = server.socket().display().to_string();
    let port = server.port.to_string();
    let closed = support::free_port().to_string();
    let run = |args: &[&str], url: &str, environment: &[(&str, &str)]| {
        let mut command = Command::new(OUTBOX);
        command.args(args).env("DATABASE_URL", url);
        for variable in ["MYSQL_UNIX_PORT", "MYSQL_TCP_PORT", "MYSQL_PWD"] {
            command.env_remove(variable);
        }
        let output = command
            .envs(environment.iter().copied())
            .output()
            .expect("run outbox");
        (output.status.success(), text(&output))
    };
    let (migrated, said) = run(
        &["migrate"],
        &format!("mysql://root@localhost:{closed}/orders?unix_socket={socket}"),
        &[],
    );
    assert!(migrated && said.contains("applied 5"), "{said}");
    let (reported, said) = run(
        &["status"],
        &format!("mysql://root@localhost:{closed}/orders"),
        &[("MYSQL_UNIX_PORT", &socket)],
    );
    assert!(reported, "{said}");
    let (reported, said) = run(
        &["status"],
        "mysql://app@127.0.0.1/orders?prefer_socket=false",
        &[("MYSQL_TCP_PORT", &port), ("MYSQL_PWD", &password)],
    );
    assert!(reported, "{said}");
    // Without the variables, the URL alone: port 3306, no password.
    let url = format!("mysql://app@127.0.0.1:{port}/orders?prefer_socket=false");
    let (reported, said) = run(&["status"], &url, &[]);
    assert!(
        !reported
            && said.contains("Access denied for user 'app'@")
            && said.contains("(using password: NO)"),
        "{said}"
    );
    // No host and no user: localhost, and the operating system's user, whom no account
    // here knows by that password.
    let login = Command::new("id").arg("-un").output().unwrap();
    let login = String::from_utf8(login.stdout).unwrap();
    let (reported, said) = run(
        &["status"],
        "mysql:///orders?prefer_socket=false",
        &[("MYSQL_TCP_PORT", &port), ("MYSQL_PWD", &password)],
    );
    assert!(
        !reported
            && said.contains(&format!("Access denied for user '{}'@", login.trim()))
            && said.contains(&format!(
                "(from the environment: MYSQL_TCP_PORT={port}, MYSQL_PWD; no host in the URL: \
                 localhost, as libmysqlclient)"
            ))
            && !said.contains(&password),
        "{said}"
    );
}

/// `outbox migrate` on a MariaDB replica's `read_only`, as an account without the privilege
/// to write through it, says that the database takes no writes and to give the primary.
/// Before: "an outbox migration failed: The MariaDB server is running with the --read-only
/// option so it cannot execute this statement", which named no way out.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_on_a_mysql_replica_names_it_and_asks_for_the_primary() {
    let server = support::mariadb::MariadbServer::start().await;
    outbox_runtime::mysql::establish(&server.url("mysql"))
        .await
        .unwrap()
        .batch_execute(
            "CREATE DATABASE orders; CREATE USER app@'%'; GRANT ALL ON orders.* TO app@'%'; \
             SET GLOBAL read_only = 1",
        )
        .await
        .unwrap();
    let output = Command::new(OUTBOX)
        .arg("migrate")
        .env(
            "DATABASE_URL",
            format!("mysql://app@127.0.0.1:{}/orders", server.port),
        )
        .output()
        .expect("run outbox");
    assert!(
        output.status.code() == Some(2)
            && text(&output).contains(
                "cannot run the outbox migrations: the database takes no writes (a replica, \
                 with read_only or super_read_only on, or transaction_read_only on for the \
                 session), and the migrations write the outbox's tables; run them on the \
                 primary's URL"
            ),
        "{}",
        text(&output)
    );
}

/// The operator's commands on MySQL (built with `--features mysql`): migrate, status, a dead
/// letter listed, shown, skipped and retried, and purge, on a database of the test's own
/// (`OUTBOX_TEST_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`, is the server).
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_commands_work_on_mysql() {
    let admin_url = std::env::var("OUTBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let name = format!(
        "outbox_cli_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    );
    let mut admin = outbox_runtime::mysql::establish(&admin_url).await.unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let (server, _) = admin_url.rsplit_once('/').expect("a database in the URL");
    let url = format!("{server}/{name}");
    let command = |args: &[&str]| {
        let output = Command::new(OUTBOX)
            .args(args)
            .env("DATABASE_URL", &url)
            .output()
            .unwrap();
        (output.status.code(), text(&output))
    };
    let (code, said) = command(&["status"]);
    assert_eq!(code, Some(2), "{said}");
    // Other databases of the server may hold outbox tables, which it names between.
    assert!(
        said.contains(
            "lacks migrations of this outbox: 20261124000001, 20261125000002, \
                       20261126000003, 20261127000004, 20261203000005; "
        ) && said.contains("run `outbox migrate`"),
        "{said}"
    );
    let (code, said) = command(&["migrate"]);
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("applied 5"), "{said}");
    let id = uuid::Uuid::now_v7().to_string();
    outbox_runtime::mysql::establish(&url)
        .await
        .unwrap()
        .batch_execute(&format!(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, \
                                        event_type, partition_key, subject, payload, attempts, \
                                        last_error, dead_lettered_at) \
             VALUES ('{id}', 'Order', 'd-1', 1, 'Shipped', 'd-1', 'app.Order.d-1.Shipped', \
                     '{{\"n\": 1}}', 3, 'refused by the test', UTC_TIMESTAMP(6)); \
             INSERT INTO outbox_inbox (consumer, source, message_id, handled_at) \
             VALUES ('billing', '', 'm-old', UTC_TIMESTAMP(6) - INTERVAL 2 DAY), \
                    ('billing', '', 'm-new', UTC_TIMESTAMP(6))"
        ))
        .await
        .unwrap();
    let (code, said) = command(&["status", "--json"]);
    assert_eq!(code, Some(0), "{said}");
    let report: serde_json::Value = serde_json::from_str(&said).unwrap();
    assert_eq!(report["dead_letters"], 1, "{report}");
    assert_eq!(
        (&report["by_type"], &report["published_last_minute"]),
        (
            &serde_json::json!([{"aggregate_type": "Order", "event_type": "Shipped",
                                 "queued": 0, "dead_letters": 1}]),
            &0.into()
        ),
        "{report}"
    );
    let (code, said) = command(&["dead-letters", "list"]);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains(&id) && said.contains("refused by the test"),
        "{said}"
    );
    outbox_runtime::mysql::establish(&url)
        .await
        .unwrap()
        .batch_execute(
            "INSERT INTO outbox_inbox_dead_letters (consumer, source, message_id, subject, \
                 headers, payload, error, deliveries, stream_sequence) \
             VALUES ('billing', '/shop', 'm-dead', 'app.Order.o-1.Placed', \
                     '{\"ce-type\": [\"Placed\"]}', '{\"n\": 2}', 'no account', 6, 41)",
        )
        .await
        .unwrap();
    let (code, said) = command(&["inbox-dead-letters", "show", "billing", "m-dead", "--json"]);
    assert_eq!(code, Some(0), "{said}");
    let shown: serde_json::Value = serde_json::from_str(&said).unwrap();
    assert_eq!(
        (&shown["payload"], &shown["headers"], &shown["source"]),
        (
            &serde_json::json!({"n": 2}),
            &serde_json::json!({"ce-type": ["Placed"]}),
            &"/shop".into()
        ),
        "{shown}"
    );
    let (code, said) = command(&["status"]);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("inbox dead letters      1 (billing 1)"),
        "{said}"
    );
    let (code, said) = command(&["inbox-dead-letters", "discard", "billing", "m-dead"]);
    assert_eq!(code, Some(0), "{said}");
    let (code, said) = command(&["inbox-dead-letters", "list"]);
    assert_eq!(
        (code, said.trim()),
        (Some(0), "no inbox dead letters"),
        "{said}"
    );
    let (code, said) = command(&["dead-letters", "show", &id, "--json"]);
    assert_eq!(code, Some(0), "{said}");
    let shown: serde_json::Value = serde_json::from_str(&said).unwrap();
    assert_eq!(shown["payload"], serde_json::json!({"n": 1}), "{shown}");
    for (args, expected, says) in [
        (["skip", id.as_str()], Some(0), "skipped"),
        (["retry", id.as_str()], Some(0), "retried"),
        (["retry", id.as_str()], Some(2), "is not a dead letter"),
    ] {
        let (code, said) = command(&args);
        assert_eq!(code, expected, "{args:?}: {said}");
        assert!(said.contains(says), "{args:?}: {said}");
    }
    let (code, said) = command(&[
        "purge",
        "--older-than",
        "1d",
        "--dedup-keys-older-than",
        "1d",
    ]);
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("deleted 0 published rows"), "{said}");
    assert!(said.contains("deleted 1 inbox rows of billing"), "{said}");
    let (code, said) = command(&["status", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&said).unwrap();
    assert_eq!(
        (code, &report["queued"], &report["dead_letters"]),
        (Some(0), &1.into(), &0.into()),
        "back in the queue: {report}"
    );
    admin
        .batch_execute(&format!("DROP DATABASE {name}"))
        .await
        .unwrap();
}

/// `outbox grants <component> <account> --mysql <database>` prints MySQL's statements, which,
/// run as root, let an account of its own run the operator's commands on MySQL; and an
/// account that may not read `__diesel_schema_migrations` is told so by the server. Before,
/// it was told that the database lacked every migration, to run `outbox migrate` (MySQL's
/// `information_schema` shows an account only the tables it holds a privilege on).
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_account_runs_the_operator_commands_on_mysql_with_the_grants_it_prints() {
    let admin_url = std::env::var("OUTBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let (name, account) = (format!("outbox_cli_{suffix}"), format!("o{suffix}_op"));
    let mut admin = outbox_runtime::mysql::establish(&admin_url).await.unwrap();
    admin
        .batch_execute(&format!(
            "CREATE DATABASE {name}; CREATE USER '{account}'@'%' IDENTIFIED BY 'pw'"
        ))
        .await
        .unwrap();
    let (server, _) = admin_url.rsplit_once('/').expect("a database in the URL");
    let url = format!("{server}/{name}");
    let as_account = support::roles::as_role(&url, &account);
    let command = |url: &str, args: &[&str]| {
        let output = Command::new(OUTBOX)
            .args(args)
            .env("DATABASE_URL", url)
            .output()
            .unwrap();
        (output.status.code(), text(&output))
    };
    let (code, said) = command(&url, &["migrate"]);
    assert_eq!(code, Some(0), "{said}");
    let output = Command::new(OUTBOX)
        .args(["grants", "operator", &account, "--mysql", &name])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let grants = String::from_utf8(output.stdout).unwrap();
    assert!(
        grants.starts_with("-- What the outbox's operator needs on MySQL or MariaDB")
            && grants.contains(&format!(
                "GRANT SELECT, UPDATE, DELETE ON `{name}`.`outbox_events` TO '{account}';"
            ))
            && !grants.contains("FUNCTION")
            && !grants.contains("outbox_topologies"),
        "{grants}"
    );
    admin.batch_execute(&grants).await.unwrap();
    for args in [
        &["status"][..],
        &["dead-letters", "list"],
        &["inbox-dead-letters", "list"],
        &[
            "purge",
            "--older-than",
            "1d",
            "--dedup-keys-older-than",
            "1d",
        ],
    ] {
        let (code, said) = command(&as_account, args);
        assert_eq!(code, Some(0), "{args:?}: {said}");
    }

    let (code, said) = command(&as_account, &["grants", "operator", "--check"]);
    assert_eq!(
        (code, said.trim()),
        (
            Some(0),
            "DATABASE_URL's role holds every privilege the operator needs"
        )
    );
    let (code, said) = command(&as_account, &["grants", "relay", "--check"]);
    assert_eq!(
        (code, said.trim()),
        (
            Some(1),
            format!(
                "the account '{account}'@'%' lacks INSERT on outbox_published, which the relay \
                 needs; as the tables' owner, run the statements `outbox grants relay {account} \
                 --mysql {name}` prints (outbox_runtime::privileges::mysql_grants)"
            )
            .as_str()
        )
    );

    admin
        .batch_execute(&format!(
            "REVOKE SELECT ON `{name}`.`__diesel_schema_migrations` FROM '{account}'"
        ))
        .await
        .unwrap();
    let (code, said) = command(&as_account, &["status"]);
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains("SELECT command denied to user")
            && said.contains("__diesel_schema_migrations")
            && !said.contains("outbox migrate"),
        "{said}"
    );
    admin
        .batch_execute(&format!("DROP DATABASE {name}; DROP USER '{account}'@'%'"))
        .await
        .unwrap();
}

/// `outbox migrate` and `outbox relay` on a SQLite file (built with `--features sqlite`): the
/// daemon publishes what units of work commit to the file, and the operator's commands
/// (status, dead letters, replay, purge) work on it.
/// `outbox migrate` on a SQLite file opened read-only (`mode=ro`) says that the file takes
/// no writes and what to give instead, both where diesel's table of migrations is still to
/// be created (its CREATE is refused) and where it exists and a migration is refused. Before:
/// "an outbox migration failed: attempt to write a readonly database", and "... Failed to
/// run 20261125000001 with: attempt to write a readonly database".
#[cfg(feature = "sqlite")]
#[test]
fn migrate_on_a_read_only_sqlite_file_names_it() {
    use outbox_runtime::diesel::connection::SimpleConnection as _;
    use outbox_runtime::diesel::{Connection as _, SqliteConnection};

    let dir = std::env::temp_dir().join(format!("outbox-cli-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    for (file, setup) in [
        ("empty.db", ""),
        (
            "begun.db",
            "CREATE TABLE __diesel_schema_migrations (version VARCHAR(50) PRIMARY KEY NOT \
             NULL, run_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP);",
        ),
    ] {
        let path = dir.join(file).to_string_lossy().into_owned();
        SqliteConnection::establish(&path)
            .unwrap()
            .batch_execute(&format!(
                "PRAGMA journal_mode = WAL; CREATE TABLE orders (id INTEGER); {setup}"
            ))
            .unwrap();
        let output = Command::new(OUTBOX)
            .arg("migrate")
            .env("DATABASE_URL", format!("file:{path}?mode=ro"))
            .output()
            .expect("run outbox");
        assert!(
            output.status.code() == Some(2)
                && text(&output).contains(
                    "cannot run the outbox migrations: the database file takes no writes \
                     (opened read-only, as mode=ro, or a file or directory this process may \
                     not write), and the migrations write the outbox's tables; run them on a \
                     file this process can write"
                ),
            "{file}: {}",
            text(&output)
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_daemon_relays_a_sqlite_file_and_stops_on_sigterm() {
    use outbox_runtime::UnitOfWorkError;
    use outbox_runtime::diesel::connection::SimpleConnection as _;
    use outbox_runtime::sqlite::AsyncSqliteConnection;

    let env = TestEnv::unmigrated(&support::nats_url()).await;
    let dir = std::env::temp_dir().join(format!("outbox-cli-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("orders.db").to_string_lossy().into_owned();
    let command = |args: &[&str]| {
        let mut command = Command::new(OUTBOX);
        command
            .args(args)
            .env("DATABASE_URL", &path)
            .env("NATS_URL", support::nats_url())
            .env("RUST_LOG", "info");
        command
    };
    // Before `migrate`: a command other than it does not create the file.
    let missing = command(&["status"]).output().unwrap();
    assert_eq!(missing.status.code(), Some(2), "{}", text(&missing));
    assert!(
        text(&missing).contains(&format!("no SQLite database at {path}")),
        "{}",
        text(&missing)
    );
    assert!(!std::path::Path::new(&path).exists(), "no file made");
    // Nor as a `file:` URI (before, SQLite made the file it was asked to open).
    for uri in [
        format!("file:{path}"),
        format!("file://localhost{path}?cache=private"),
    ] {
        let missing = command(&["status"])
            .env("DATABASE_URL", &uri)
            .output()
            .unwrap();
        assert_eq!(missing.status.code(), Some(2), "{uri}: {}", text(&missing));
        assert!(
            text(&missing).contains(&format!("no SQLite database at {path}")),
            "{uri}: {}",
            text(&missing)
        );
        assert!(!std::path::Path::new(&path).exists(), "{uri}: a file made");
    }
    let migrated = command(&["migrate"]).output().unwrap();
    assert!(migrated.status.success(), "{}", text(&migrated));
    assert!(text(&migrated).contains("applied 6"), "{}", text(&migrated));
    outbox_runtime::sqlite::establish(&path)
        .unwrap()
        .batch_execute(
            "INSERT INTO outbox_inbox (consumer, source, message_id, handled_at) \
             VALUES ('billing', '', 'm-old', strftime('%Y-%m-%d %H:%M:%f', 'now', '-2 days')), \
                    ('billing', '', 'm-new', strftime('%Y-%m-%d %H:%M:%f', 'now')); \
             INSERT INTO outbox_inbox_dead_letters (consumer, source, message_id, subject, \
                 headers, payload, error, deliveries, stream_sequence) \
             VALUES ('billing', '/shop', 'm-dead', 'app.Order.o-1.Placed', '{}', \
                     CAST('{\"n\": 2}' AS BLOB), 'no account', 6, 41)",
        )
        .unwrap();
    let letters = command(&["dead-letters", "list"]).output().unwrap();
    assert_eq!(letters.status.code(), Some(0), "{}", text(&letters));
    assert!(
        text(&letters).contains("no dead letters"),
        "{}",
        text(&letters)
    );
    let shown = command(&["inbox-dead-letters", "show", "billing", "m-dead", "--json"])
        .output()
        .unwrap();
    assert_eq!(shown.status.code(), Some(0), "{}", text(&shown));
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(
        (&shown["payload"], &shown["error"], &shown["deliveries"]),
        (
            &serde_json::json!({"n": 2}),
            &"no account".into(),
            &6.into()
        ),
        "{shown}"
    );
    let discarded = command(&["inbox-dead-letters", "discard", "billing", "m-dead"])
        .output()
        .unwrap();
    assert_eq!(discarded.status.code(), Some(0), "{}", text(&discarded));
    let listed = command(&["inbox-dead-letters", "list"]).output().unwrap();
    assert!(
        text(&listed).contains("no inbox dead letters"),
        "{}",
        text(&listed)
    );
    let purged = command(&[
        "purge",
        "--older-than",
        "1d",
        "--dedup-keys-older-than",
        "1d",
    ])
    .output()
    .unwrap();
    assert_eq!(purged.status.code(), Some(0), "{}", text(&purged));
    assert!(
        text(&purged).contains("deleted 0 published rows older than 1day")
            && text(&purged).contains("deleted 0 dedup keys")
            && text(&purged).contains("deleted 1 inbox rows of billing"),
        "{}",
        text(&purged)
    );
    let mut conn = AsyncSqliteConnection::new(outbox_runtime::sqlite::establish(&path).unwrap());
    let commit = async |conn: &mut AsyncSqliteConnection, n: usize| {
        let mut order = support::domain::Order::place(&format!("o-{n}"), "ada", 1);
        order.record(support::domain::OrderEvent::Shipped);
        env.outbox()
            .transaction(conn, async |uow| {
                uow.track(&mut order);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap();
    };
    // Before the relay: `status` shows what waits, and `--max-lag` judges its age.
    commit(&mut conn, 0).await;
    let status = command(&["status", "--json"]).output().unwrap();
    assert_eq!(status.status.code(), Some(0), "{}", text(&status));
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(report["queued"], 2, "{report}");
    assert_eq!(report["dead_letters"], 0, "{report}");
    assert!(report["lag_seconds"].as_f64().unwrap() > 0.0, "{report}");
    let types: Vec<_> = report["by_type"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            (
                row["event_type"].as_str().unwrap(),
                row["queued"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(types, [("Placed", 1), ("Shipped", 1)], "{report}");
    std::thread::sleep(Duration::from_millis(20));
    let probe = command(&["status", "--max-lag", "10ms"]).output().unwrap();
    assert_eq!(probe.status.code(), Some(1), "{}", text(&probe));
    assert!(
        text(&probe).contains("the lag is over --max-lag 10ms"),
        "{}",
        text(&probe)
    );

    let address = format!("127.0.0.1:{}", support::free_port());
    let relay = command(&[
        "relay",
        "--subject-prefix",
        &env.prefix,
        "--stream",
        &env.stream,
        "--stats-interval",
        "200ms",
        "--metrics-addr",
        &address,
        "--published",
        "archive",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    for n in 1..3 {
        commit(&mut conn, n).await;
    }
    // Another process's commits: the relay sees them at its poll.
    env.until_stream_holds(6, Duration::from_secs(20)).await;
    // The outbox's gauges, read from the file.
    let scraped = scraped_once_drained(&address, 6.0).await;
    for drained in [
        "outbox_dead_letters 0",
        "outbox_blocked_events 0",
        "outbox_oldest_queued_age_seconds 0",
    ] {
        assert!(scraped.contains(drained), "{drained} in\n{scraped}");
    }
    let status = command(&["status", "--json", "--max-lag", "1m"])
        .output()
        .unwrap();
    assert_eq!(status.status.code(), Some(0), "{}", text(&status));
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        (
            &report["queued"],
            &report["lag_seconds"],
            &report["published_last_minute"]
        ),
        (&0.into(), &0.0.into(), &6.into()),
        "the six rows archived: {report}"
    );
    let (output, took, code) = stop(relay).await;
    assert_eq!(code, Some(0), "{output}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(
        output.contains("relaying") && output.contains("stopped"),
        "{output}"
    );
    // `replay` publishes the file's archive again, to a stream of its own.
    let target = TestEnv::unmigrated(&support::nats_url()).await;
    let replayed = command(&[
        "replay",
        "--subject-prefix",
        &env.prefix,
        "--to-prefix",
        &target.prefix,
        "--to-stream",
        &target.stream,
    ])
    .output()
    .unwrap();
    assert_eq!(replayed.status.code(), Some(0), "{}", text(&replayed));
    assert!(
        text(&replayed).starts_with(&format!("replayed 6 events to stream {}", target.stream)),
        "{}",
        text(&replayed)
    );
    assert_eq!(target.stream_len().await, 6);
    // `purge` deletes the archived rows older than it is told, and only those.
    conn.batch_execute(
        "UPDATE outbox_published SET published_at = '2000-01-01 00:00:00.000' \
         WHERE aggregate_id = 'o-1'",
    )
    .await
    .unwrap();
    let purged = command(&["purge", "--older-than", "1d"]).output().unwrap();
    assert_eq!(purged.status.code(), Some(0), "{}", text(&purged));
    assert!(
        text(&purged).contains("deleted 2 archived rows older than 1day"),
        "{}",
        text(&purged)
    );
    let kept: i64 = {
        use diesel_async::RunQueryDsl;
        diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM outbox_published")
            .get_result(&mut conn)
            .await
            .unwrap()
    };
    assert_eq!(kept, 4, "o-0's and o-2's rows are kept");

    // An operator's dead letter on the file: listed, shown, skipped, retried.
    let id = uuid::Uuid::now_v7().to_string();
    conn.batch_execute(&format!(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, aggregate_seq, event_type, \
                                    partition_key, subject, payload, attempts, last_error, \
                                    dead_lettered_at) \
         VALUES ('{id}', 'Order', 'd-1', 1, 'Shipped', 'd-1', '{}.Order.d-1.Shipped', \
                 '{{\"n\": 1}}', 3, 'refused by the test', \
                 strftime('%Y-%m-%d %H:%M:%f', 'now'))",
        env.prefix
    ))
    .await
    .unwrap();
    let listed = command(&["dead-letters", "list", "--json"])
        .output()
        .unwrap();
    assert_eq!(listed.status.code(), Some(0), "{}", text(&listed));
    let letter: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(
        (&letter["id"], &letter["attempts"], &letter["last_error"]),
        (&id.clone().into(), &3.into(), &"refused by the test".into()),
        "{letter}"
    );
    let shown = command(&["dead-letters", "show", &id, "--json"])
        .output()
        .unwrap();
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["payload"], serde_json::json!({"n": 1}), "{shown}");
    for (args, code, said) in [
        (["skip", id.as_str()], 0, "skipped"),
        (["skip", id.as_str()], 2, "is not a blocking dead letter"),
        (["retry", id.as_str()], 0, "retried"),
        (["retry", id.as_str()], 2, "is not a dead letter"),
    ] {
        let done = command(&args).output().unwrap();
        assert_eq!(done.status.code(), Some(code), "{args:?}: {}", text(&done));
        assert!(text(&done).contains(said), "{args:?}: {}", text(&done));
    }
    let status = command(&["status", "--json"]).output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        (&report["queued"], &report["dead_letters"]),
        (&1.into(), &0.into()),
        "back in the queue: {report}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `outbox grants` writes the statements of the database DATABASE_URL names: MySQL's for a
/// `mysql://` URL, on its database, where it wrote PostgreSQL's, which MySQL refuses; none for
/// a SQLite file, which has no grants; `--mysql` names the database whatever the URL.
#[test]
fn grants_are_written_for_the_database_that_database_url_names() {
    let grants = |url: &str, args: &[&str]| {
        let output = Command::new(OUTBOX)
            .args(["grants", "relay", "outbox_relay"])
            .args(args)
            .env("DATABASE_URL", url)
            .output()
            .unwrap();
        (output.status.code(), text(&output))
    };
    let (code, said) = grants("mysql://root@db.internal:3306/sh%60op?ssl_ca=/ca.pem", &[]);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.starts_with("-- What the outbox's relay needs on MySQL or MariaDB")
            && said.contains(
                "GRANT SELECT, UPDATE, DELETE ON `sh``op`.`outbox_events` TO 'outbox_relay';"
            ),
        "{said}"
    );
    let (code, said) = grants("mysql://root@db.internal:3306", &[]);
    assert_eq!(
        (code, said.trim()),
        (
            Some(2),
            "outbox: DATABASE_URL is MySQL's and names no database: give the outbox's with \
             --mysql <database>"
        )
    );
    let (code, said) = grants("mysql://root@db.internal:3306", &["--mysql", "shop"]);
    assert!(
        code == Some(0) && said.contains("ON `shop`.`outbox_events`"),
        "{said}"
    );
    let (code, said) = grants("orders.db", &[]);
    assert_eq!(
        (code, said.trim()),
        (
            Some(2),
            "outbox: DATABASE_URL is a SQLite file: SQLite has no roles or grants (the file's \
             permissions are what guard it)"
        )
    );
    let (code, said) = grants("postgres://app@db.internal/shop", &[]);
    assert!(
        code == Some(0) && said.contains("ON TABLE \"public\".\"outbox_events\""),
        "{said}"
    );
}

/// `outbox grants <component> --check` tells whether DATABASE_URL's role holds what the
/// component needs (exit 0), or names each privilege it lacks and the command that writes the
/// grants (exit 1), where a service's role, which nothing checks before its first unit of
/// work, was only found wanting by that unit of work's "permission denied".
#[tokio::test]
async fn grants_check_tells_whether_a_role_holds_what_a_component_needs() {
    use outbox_runtime::privileges::Component;
    let env = TestEnv::new().await;
    let role = support::roles::role(&env, "checked", &[Component::Service]).await;
    let check = |component: &str| {
        let output = command(&env, &support::nats_url())
            .env("DATABASE_URL", &role.url)
            .args(["grants", component, "--check"])
            .output()
            .unwrap();
        (output.status.code(), text(&output))
    };
    let (code, said) = check("service");
    assert_eq!(
        (code, said.trim()),
        (
            Some(0),
            "DATABASE_URL's role holds every privilege the service needs"
        )
    );
    let (code, said) = check("relay");
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.starts_with(&format!(
            "the role \"{}\" lacks UPDATE on outbox_events, DELETE on outbox_events,",
            role.name
        )) && said.contains(&format!(
            "which the relay needs; as the tables' owner, run the statements `outbox grants \
             relay {}` prints",
            role.name
        )),
        "{said}"
    );
    let (code, said) = check("inbox");
    assert!(
        code == Some(1) && said.contains("lacks SELECT on outbox_inbox,"),
        "{said}"
    );
    // A table the database lacks is no privilege lacking: the migrations are named.
    let unmigrated = TestEnv::unmigrated(&support::nats_url()).await;
    let output = command(&unmigrated, &support::nats_url())
        .args(["grants", "service", "--check"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains("lacks migrations of this outbox")
            && text(&output).contains("run `outbox migrate`"),
        "{}",
        text(&output)
    );
    // A role is needed to print the statements, not to check them.
    let output = command(&env, &support::nats_url())
        .args(["grants", "relay"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    support::roles::drop_roles(&env, &[&role]).await;
}

/// `outbox grants` prints statements that, run as the tables' owner, let a role of its own
/// run the operator's commands; and a role that does not own the archive is told, when it
/// meets an archive day to drop, that only the owner may, rather than "must be owner of
/// table outbox_published" alone.
#[tokio::test]
async fn an_operator_role_runs_the_operator_commands_with_the_grants_it_prints() {
    let env = TestEnv::new().await;
    insert(&env, "o-1", 1, "Placed", DEAD).await;
    insert(&env, "o-2", 1, "Placed", DEAD).await;
    let role = support::roles::role(&env, "operator", &[]).await;
    let printed = outbox(
        &env,
        &support::nats_url(),
        &["grants", "operator", &role.name],
    );
    assert!(printed.status.success(), "{}", text(&printed));
    let grants = String::from_utf8(printed.stdout).unwrap();
    assert!(
        grants.starts_with("-- What the outbox's operator needs")
            && grants.contains(&format!(
                "GRANT SELECT, UPDATE, DELETE ON TABLE \"public\".\"outbox_events\" TO \"{}\";",
                role.name
            )),
        "{grants}"
    );
    let as_role = |args: &[&str]| {
        command(&env, &support::nats_url())
            .env("DATABASE_URL", &role.url)
            .args(args)
            .output()
            .expect("run outbox")
    };
    // Without the grants: the first table it reads is named.
    let refused = as_role(&["status"]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(
        text(&refused).contains("permission denied for table"),
        "{}",
        text(&refused)
    );

    env.conn().await.batch_execute(&grants).await.unwrap();
    let id: String = {
        let list = as_role(&["dead-letters", "list", "--json"]);
        assert!(list.status.success(), "{}", text(&list));
        let first = String::from_utf8_lossy(&list.stdout)
            .lines()
            .next()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .unwrap();
        first["id"].as_str().unwrap().to_owned()
    };
    for args in [
        &["status"][..],
        &["dead-letters", "show", &id],
        &["skip", &id],
        &["retry", &id],
        &["inbox-dead-letters", "list"],
        &["inbox-dead-letters", "discard", "--all"],
        &[
            "purge",
            "--older-than",
            "1d",
            "--dedup-keys-older-than",
            "1d",
        ],
    ] {
        let done = as_role(args);
        assert!(done.status.success(), "{args:?}: {}", text(&done));
    }

    // An archive day to drop, which only the owner may.
    env.conn()
        .await
        .batch_execute(
            "CREATE TABLE outbox_published_p20200101 PARTITION OF outbox_published \
             FOR VALUES FROM ('2020-01-01 00:00Z') TO ('2020-01-02 00:00Z')",
        )
        .await
        .unwrap();
    let refused = as_role(&["purge", "--older-than", "1d"]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(
        text(&refused).contains(
            "purging the archive: must be owner of table outbox_published: only \
             outbox_published's owner may drop the archive's days (no grant gives it); run \
             this as the role that ran `outbox migrate`"
        ),
        "{}",
        text(&refused)
    );
    let owner = outbox(&env, &support::nats_url(), &["purge", "--older-than", "1d"]);
    assert!(
        text(&owner).contains("dropped archive partition outbox_published_p20200101"),
        "{}",
        text(&owner)
    );
    support::roles::drop_roles(&env, &[&role]).await;
}

/// `outbox replay` publishes what the relay archived to a stream of its own and prints where
/// it ended; `--after` that position replays only what was archived since, and a replay that
/// cannot select anything, or is given a position that is not one, is refused naming why.
#[tokio::test]
async fn replay_publishes_the_archive_to_its_stream_and_resumes_after_what_it_printed() {
    let env = TestEnv::new().await;
    let target = TestEnv::new().await;
    for n in 0..3 {
        let mut order = support::domain::Order::place(&format!("o-{n}"), "ada", 1);
        order.record(support::domain::OrderEvent::Shipped);
        env.commit(&mut order).await;
    }
    support::consumer::archive_all(&env).await;
    let base = [
        "replay",
        "--subject-prefix",
        &env.prefix,
        "--source",
        "/tests",
        "--to-prefix",
        &target.prefix,
        "--to-stream",
        &target.stream,
    ];
    let replay = |extra: &[&str]| outbox(&env, &support::nats_url(), &[&base[..], extra].concat());

    let first = replay(&[]);
    let said = text(&first);
    assert_eq!(first.status.code(), Some(0), "{said}");
    let stdout = String::from_utf8_lossy(&first.stdout).into_owned();
    assert!(
        stdout.starts_with(&format!(
            "replayed 6 events to stream {} (0 it held already); the last: [\"Order\",\"o-2\",2,",
            target.stream
        )),
        "{said}"
    );
    assert_eq!(target.stream_len().await, 6);
    // The stream it created keeps message ids 10 s, not a stream's default 2 minutes: each
    // id in the window takes broker memory, and a replay publishes millions.
    let window = |env: &TestEnv| {
        let js = env.jetstream();
        let stream = env.stream.clone();
        async move {
            let mut stream = js.get_stream(&stream).await.unwrap();
            stream.info().await.unwrap().config.duplicate_window
        }
    };
    assert_eq!(window(&target).await, Duration::from_secs(10));
    let last = stdout
        .split("the last: ")
        .nth(1)
        .and_then(|rest| rest.split(" (--after").next())
        .unwrap();

    let mut order = support::domain::Order::place("o-3", "ada", 1);
    env.commit(&mut order).await;
    support::consumer::archive_all(&env).await;
    let resumed = replay(&["--after", last]);
    let said = text(&resumed);
    assert_eq!(resumed.status.code(), Some(0), "{said}");
    assert!(said.starts_with("replayed 1 event to stream"), "{said}");
    assert_eq!(target.stream_len().await, 7);
    let none = replay(&["--since", "1h", "--aggregate-type", "Invoice"]);
    assert_eq!(none.status.code(), Some(0), "{}", text(&none));
    assert!(
        text(&none).contains("no archived event matched: nothing replayed"),
        "{}",
        text(&none)
    );

    let before_connecting = |extra: &[&str], says: &str| {
        refused_before_connecting(&env, &[&base[..], extra].concat(), &[says]);
    };
    before_connecting(
        &["--since", "1h", "--before", "2000-01-01T00:00:00Z"],
        "is not before published_before",
    );
    before_connecting(&["--since", "yesterday"], "is neither an RFC 3339 time");
    before_connecting(
        &["--batch-size", "0"],
        "batch_size 0 is outside 1 to 100,000",
    );
    before_connecting(
        &["--to-duplicate-window", "0s"],
        "the replay's stream duplicate_window 0ns is no window",
    );
    before_connecting(
        &["--to-duplicate-window", "2m", "--to-max-age", "1m"],
        "duplicate_window 120s is longer than max_age 60s",
    );
    // Given, the window is the operator's; a max age shorter than 10 s bounds the default.
    for (extra, expected) in [
        (
            &["--to-duplicate-window", "45s"][..],
            Duration::from_secs(45),
        ),
        (&["--to-max-age", "5s"][..], Duration::from_secs(5)),
    ] {
        let other = TestEnv::new().await;
        let replayed = outbox(
            &env,
            &support::nats_url(),
            &[
                &base[..base.len() - 4],
                &["--to-prefix", &other.prefix, "--to-stream", &other.stream],
                extra,
            ]
            .concat(),
        );
        assert_eq!(replayed.status.code(), Some(0), "{}", text(&replayed));
        assert_eq!(window(&other).await, expected, "{extra:?}");
    }
    let no_source = [
        "replay",
        "--source",
        "",
        "--to-prefix",
        &target.prefix,
        "--to-stream",
        &target.stream,
    ];
    refused_before_connecting(
        &env,
        &no_source,
        &["CloudEvents requires a non-empty source"],
    );
    for (after, says) in [
        ("o-2,2", "is not an archive position, a JSON array"),
        ("[\"Order\",\"o-2\",2]", "invalid length 3"),
    ] {
        let refused = replay(&["--after", after]);
        assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
        assert!(text(&refused).contains(says), "{after}: {}", text(&refused));
    }
    let live = outbox(
        &env,
        &support::nats_url(),
        &[
            "replay",
            "--subject-prefix",
            &env.prefix,
            "--to-prefix",
            &format!("{}.replay", env.prefix),
            "--to-stream",
            &target.stream,
        ],
    );
    assert_eq!(live.status.code(), Some(2), "{}", text(&live));
    assert!(
        text(&live).contains(&format!(
            "the replay's prefix `{}.replay` is the producer's prefix `{}` or shares its subjects",
            env.prefix, env.prefix
        )),
        "{}",
        text(&live)
    );
    assert_eq!(target.stream_len().await, 7, "nothing more published");
}

/// An operator command whose role lacks a privilege on the outbox's tables says what to grant,
/// not only "permission denied for table ...": `status` without SELECT on `outbox_events`,
/// `retry --all` without UPDATE on it, `replay` without SELECT on the archive.
#[tokio::test]
async fn an_operator_command_whose_role_lacks_a_privilege_names_what_to_grant() {
    use outbox_runtime::privileges::Component;
    let env = TestEnv::new().await;
    let target = TestEnv::new().await;
    let role = support::roles::role(&env, "operator", &[Component::Operator]).await;
    env.conn()
        .await
        .batch_execute(&format!(
            "REVOKE SELECT, UPDATE ON outbox_events FROM {0}; \
             REVOKE SELECT ON outbox_published FROM {0}",
            role.name
        ))
        .await
        .unwrap();
    let hint = "the role the operator logs in as lacks a privilege the operator needs; as the \
                tables' owner, run the statements `outbox grants operator <role>` prints";
    for (args, refused) in [
        (vec!["status"], "permission denied for table outbox_events"),
        (
            vec!["retry", "--all"],
            "permission denied for table outbox_events",
        ),
        (
            vec![
                "replay",
                "--subject-prefix",
                &env.prefix,
                "--to-prefix",
                &target.prefix,
                "--to-stream",
                &target.stream,
            ],
            "permission denied for table outbox_published",
        ),
    ] {
        let output = command(&env, &support::nats_url())
            .env("DATABASE_URL", &role.url)
            .args(&args)
            .output()
            .unwrap();
        let said = text(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {said}");
        assert!(
            said.contains(&format!("{refused}: {hint}")),
            "{args:?}: {said}"
        );
    }
    support::roles::drop_roles(&env, &[&role]).await;
}
