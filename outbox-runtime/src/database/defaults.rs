//! What a PostgreSQL connection string leaves out, taken where libpq takes it (PostgreSQL
//! docs, "libpq: Environment Variables" and "libpq: Parameter Key Words"), so that the string
//! a service's libpq connections take (diesel's `PgConnection`, `psql`) also connects the
//! toolkit's own, which tokio-postgres opens and which read no environment:
//!
//! - the host: `PGHOST` (hosts separated by commas, a name that starts with `/` the
//!   directory of a Unix socket) and `PGHOSTADDR` (IP addresses, one per host, connected to
//!   where both are set, the host's name then kept for TLS's checks); else, as libpq, a Unix
//!   socket in its default directory: the first of `/var/run/postgresql` (the directory of
//!   Debian's and Ubuntu's libpq) and `/tmp` (libpq's own default) that holds the socket of
//!   the port (`.s.PGSQL.5432`), and where neither does, `localhost` over TCP (libpq's default
//!   where it has no Unix sockets; a server in a container publishes only its TCP port);
//! - the port: `PGPORT` (ports separated by commas, one per host), else 5432;
//! - the user: `PGUSER`, else the operating system's user (libpq's default, and
//!   tokio-postgres's, set here so that the password file is searched for it too);
//! - the database: `PGDATABASE`, else the user's name;
//! - the server's command-line `options`: `PGOPTIONS` (`-c search_path=orders`);
//! - the name `pg_stat_activity` shows: `PGAPPNAME` (else the relay's, the inbox's or the
//!   migrations' own, `crate::database`'s `connect`);
//! - the time one host has to answer: `PGCONNECT_TIMEOUT`, whole seconds (0 or less: none;
//!   1: 2, libpq's least);
//! - which server of several hosts to stay on: `PGTARGETSESSIONATTRS`, `any`, `read-write` or
//!   `read-only` (the values tokio-postgres knows of libpq's; `read-write` is what a relay and
//!   an inbox need of a list of a primary and its standbys).
//!
//! A value the string gives is never replaced. `PGPASSWORD` and the password file are the
//! module `password`'s, the TLS variables (`PGSSLMODE`, ...) the module `tls`'s.

use std::net::IpAddr;
use std::path::Path;

/// The socket directories tried, in order, for a string and an environment without a host.
#[cfg(unix)]
const SOCKET_DIRECTORIES: [&str; 2] = ["/var/run/postgresql", "/tmp"];

/// Fills what `config`, parsed from the connection string `text`, leaves out from the
/// process's environment and libpq's defaults ([the module](self)); `text` tells a setting
/// the string gives from tokio-postgres's default where the two read the same
/// (`target_session_attrs=any`). Returns what it took, for the error of a connection that then
/// fails, which the string alone would not explain: the variables read, with their values
/// (`from the environment: PGHOST=/run/pg, PGUSER=app`), and where the string and the
/// environment gave no host, the one taken and why; `None` where it took nothing.
///
/// # Errors
/// A variable whose value is not one (`PGPORT=abc`, `PGHOSTADDR=db.internal`,
/// `PGTARGETSESSIONATTRS=primary`), named.
pub(crate) fn fill(
    config: &mut tokio_postgres::Config,
    text: &str,
) -> Result<Option<String>, String> {
    fill_from(
        config,
        &|key| super::service::Written::of(text).gives(key),
        &|name| std::env::var(name).ok().filter(|value| !value.is_empty()),
        &|socket| socket.exists(),
        &|| whoami::username().ok(),
    )
}

/// [`fill`], with `given` whether the string `config` was parsed from sets a key,
/// `environment` the process's variables, `listening` whether a socket file exists and
/// `login` the operating system's user.
fn fill_from(
    config: &mut tokio_postgres::Config,
    given: &dyn Fn(&str) -> bool,
    environment: &dyn Fn(&str) -> Option<String>,
    listening: &dyn Fn(&Path) -> bool,
    login: &dyn Fn() -> Option<String>,
) -> Result<Option<String>, String> {
    let mut taken = Vec::new();
    let mut take = |name: &'static str| {
        let value = environment(name)?;
        taken.push(format!("{name}={value}"));
        Some(value)
    };
    if config.get_ports().is_empty()
        && let Some(ports) = take("PGPORT")
    {
        for port in ports.split(',') {
            let port = port.trim();
            match port.parse::<u16>() {
                Ok(port) if port > 0 => config.port(port),
                _ => {
                    return Err(format!(
                        "PGPORT={ports}: `{port}` is not a port number (1 to 65535)"
                    ));
                }
            };
        }
    }
    let mut defaulted = None;
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        let hosts = take("PGHOST");
        let addresses = take("PGHOSTADDR");
        for host in hosts.iter().flat_map(|hosts| hosts.split(',')) {
            let host = host.trim();
            if host.is_empty() {
                return Err(format!(
                    "PGHOST={}: an empty host name",
                    hosts.as_deref().unwrap_or_default()
                ));
            }
            config.host(host);
        }
        for address in addresses.iter().flat_map(|addresses| addresses.split(',')) {
            let address = address.trim();
            let parsed = address.parse::<IpAddr>().map_err(|_| {
                format!(
                    "PGHOSTADDR={}: `{address}` is not an IP address",
                    addresses.as_deref().unwrap_or_default()
                )
            })?;
            config.hostaddr(parsed);
        }
        if hosts.is_none() && addresses.is_none() {
            defaulted = Some(default_host(config, listening));
        }
    }
    if config.get_user().is_none()
        && let Some(user) = take("PGUSER").or_else(login)
    {
        config.user(user);
    }
    if config.get_dbname().is_none()
        && let Some(dbname) = take("PGDATABASE")
    {
        config.dbname(dbname);
    }
    if config.get_options().is_none()
        && let Some(options) = take("PGOPTIONS")
    {
        config.options(options);
    }
    if config.get_application_name().is_none()
        && let Some(name) = take("PGAPPNAME")
    {
        config.application_name(name);
    }
    if config.get_connect_timeout().is_none()
        && let Some(seconds) = take("PGCONNECT_TIMEOUT")
    {
        let whole = seconds.trim().parse::<i64>().map_err(|_| {
            format!("PGCONNECT_TIMEOUT={seconds}: `{seconds}` is not a whole number of seconds")
        })?;
        // "The minimum allowed timeout is 2 seconds, therefore a value of 1 is interpreted as
        // 2", and zero, negative or none waits indefinitely (PostgreSQL docs, "libpq:
        // Parameter Key Words", connect_timeout).
        if whole > 0 {
            config.connect_timeout(std::time::Duration::from_secs(whole.max(2).unsigned_abs()));
        }
    }
    if !given("target_session_attrs")
        && let Some(attributes) = take("PGTARGETSESSIONATTRS")
    {
        use tokio_postgres::config::TargetSessionAttrs;
        let attributes_of = match attributes.trim() {
            "any" => TargetSessionAttrs::Any,
            "read-write" => TargetSessionAttrs::ReadWrite,
            "read-only" => TargetSessionAttrs::ReadOnly,
            other => {
                return Err(format!(
                    "PGTARGETSESSIONATTRS={other}: the toolkit's connections (tokio-postgres) \
                     take `any`, `read-write` or `read-only` (libpq's primary, standby and \
                     prefer-standby they lack); a relay and an inbox need the primary: \
                     read-write"
                ));
            }
        };
        config.target_session_attrs(attributes_of);
    }
    let taken = (!taken.is_empty()).then(|| format!("from the environment: {}", taken.join(", ")));
    Ok(match (taken, defaulted) {
        (Some(taken), Some(defaulted)) => Some(format!("{taken}; {defaulted}")),
        (taken, defaulted) => taken.or(defaulted),
    })
}

/// Gives `config`, which names no host, libpq's default one: the first socket directory
/// holding the port's socket, else `localhost`. Returns what it chose and why.
fn default_host(config: &mut tokio_postgres::Config, listening: &dyn Fn(&Path) -> bool) -> String {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    #[cfg(unix)]
    {
        let socket = format!(".s.PGSQL.{port}");
        let found = SOCKET_DIRECTORIES
            .into_iter()
            .find(|directory| listening(&Path::new(directory).join(&socket)));
        if let Some(directory) = found {
            config.host_path(directory);
            return format!(
                "no host in the string nor PGHOST: the Unix socket {directory}/{socket}, as libpq"
            );
        }
        config.host("localhost");
        format!(
            "no host in the string nor PGHOST, and no socket {socket} in {}: localhost",
            SOCKET_DIRECTORIES.join(" or ")
        )
    }
    #[cfg(not(unix))]
    {
        let _ = (port, listening);
        config.host("localhost");
        "no host in the string nor PGHOST: localhost, as libpq".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_postgres::config::Host;

    fn filled(
        url: &str,
        environment: &[(&str, &str)],
        listening: &[&str],
    ) -> (tokio_postgres::Config, Result<Option<String>, String>) {
        let mut config: tokio_postgres::Config = url.parse().unwrap();
        let result = fill_from(
            &mut config,
            &|key| super::super::service::Written::of(url).gives(key),
            &crate::environment_of(environment),
            &|socket| listening.iter().any(|path| Path::new(path) == socket),
            &|| Some("login".to_owned()),
        );
        (config, result)
    }

    #[test]
    fn the_environment_gives_what_the_string_leaves_out_and_nothing_it_gives() {
        let everything = [
            ("PGHOST", "db-1.internal,/run/pg"),
            ("PGPORT", "5433,5434"),
            ("PGUSER", "app"),
            ("PGDATABASE", "orders"),
            ("PGOPTIONS", "-c search_path=orders"),
        ];
        let (config, result) = filled("postgres://", &everything, &[]);
        assert_eq!(
            result.unwrap().as_deref(),
            Some(
                "from the environment: PGPORT=5433,5434, PGHOST=db-1.internal,/run/pg, \
                 PGUSER=app, PGDATABASE=orders, PGOPTIONS=-c search_path=orders"
            )
        );
        assert_eq!(
            config.get_hosts(),
            [
                Host::Tcp("db-1.internal".to_owned()),
                Host::Unix("/run/pg".into())
            ]
        );
        assert_eq!(config.get_ports(), [5433, 5434]);
        assert_eq!(config.get_user(), Some("app"));
        assert_eq!(config.get_dbname(), Some("orders"));
        assert_eq!(config.get_options(), Some("-c search_path=orders"));

        let given = "postgres://relay@db.internal:6432/billing?options=-c%20search_path%3Dbilling";
        // Nothing taken, nothing said.
        let (config, result) = filled(given, &everything, &[]);
        assert_eq!(result, Ok(None));
        assert_eq!(config.get_hosts(), [Host::Tcp("db.internal".to_owned())]);
        assert_eq!(config.get_ports(), [6432]);
        assert_eq!(config.get_user(), Some("relay"));
        assert_eq!(config.get_dbname(), Some("billing"));
        assert_eq!(config.get_options(), Some("-c search_path=billing"));

        // Without PGUSER, the operating system's user, as libpq.
        let (config, _) = filled("postgres://db.internal/orders", &[], &[]);
        assert_eq!(config.get_user(), Some("login"));

        // A `hostaddr` in the string is a host: PGHOST is not read.
        let (config, _) = filled("hostaddr=10.0.0.7 dbname=orders", &everything, &[]);
        assert!(config.get_hosts().is_empty());
        assert_eq!(
            config.get_hostaddrs(),
            ["10.0.0.7".parse::<IpAddr>().unwrap()]
        );

        let (config, _) = filled("postgres:///orders", &[("PGHOSTADDR", "10.0.0.7")], &[]);
        assert_eq!(
            config.get_hostaddrs(),
            ["10.0.0.7".parse::<IpAddr>().unwrap()]
        );
    }

    #[cfg(unix)]
    #[test]
    fn without_a_host_the_first_directory_with_the_ports_socket_else_localhost() {
        let (config, result) = filled(
            "postgres:///orders",
            &[],
            &["/var/run/postgresql/.s.PGSQL.5432", "/tmp/.s.PGSQL.5432"],
        );
        assert_eq!(
            config.get_hosts(),
            [Host::Unix("/var/run/postgresql".into())]
        );
        assert!(
            result
                .unwrap()
                .unwrap()
                .contains("/var/run/postgresql/.s.PGSQL.5432")
        );

        // The port's socket: PGPORT's here.
        let (config, result) = filled(
            "postgres:///orders",
            &[("PGPORT", "5433")],
            &["/var/run/postgresql/.s.PGSQL.5432", "/tmp/.s.PGSQL.5433"],
        );
        assert_eq!(config.get_hosts(), [Host::Unix("/tmp".into())]);
        assert_eq!(
            result.unwrap().as_deref(),
            Some(
                "from the environment: PGPORT=5433; no host in the string nor PGHOST: the Unix \
                 socket /tmp/.s.PGSQL.5433, as libpq"
            )
        );

        let (config, result) = filled(
            "postgres:///orders",
            &[],
            &["/var/run/postgresql/.s.PGSQL.5433"],
        );
        assert_eq!(config.get_hosts(), [Host::Tcp("localhost".to_owned())]);
        let why = result.unwrap().unwrap();
        assert!(
            why.contains("no socket .s.PGSQL.5432 in /var/run/postgresql or /tmp: localhost"),
            "{why}"
        );
    }

    #[test]
    fn a_variable_that_is_not_a_value_of_its_kind_is_named() {
        for (variable, value, error) in [
            (
                "PGPORT",
                "5432,abc",
                "PGPORT=5432,abc: `abc` is not a port number",
            ),
            ("PGPORT", "0", "PGPORT=0: `0` is not a port number"),
            (
                "PGHOST",
                "db-1,,db-2",
                "PGHOST=db-1,,db-2: an empty host name",
            ),
            (
                "PGHOSTADDR",
                "db.internal",
                "PGHOSTADDR=db.internal: `db.internal` is not an IP address",
            ),
        ] {
            let (_, result) = filled("postgres:///orders", &[(variable, value)], &[]);
            let message = result.unwrap_err();
            assert!(message.starts_with(error), "{message}");
        }
    }

    #[test]
    fn the_name_the_connect_timeout_and_the_session_attributes_come_as_libpq_takes_them() {
        use tokio_postgres::config::TargetSessionAttrs;
        let timeout = |value: &str| {
            let (config, result) =
                filled("postgres://db/orders", &[("PGCONNECT_TIMEOUT", value)], &[]);
            result.map(|_| config.get_connect_timeout().copied())
        };
        assert_eq!(timeout("10"), Ok(Some(std::time::Duration::from_secs(10))));
        assert_eq!(timeout("1"), Ok(Some(std::time::Duration::from_secs(2))));
        assert_eq!(timeout("0"), Ok(None));
        assert_eq!(timeout("-3"), Ok(None));
        assert_eq!(
            timeout("5s"),
            Err("PGCONNECT_TIMEOUT=5s: `5s` is not a whole number of seconds".to_owned())
        );
        let (config, _) = filled(
            "postgres://db/orders?connect_timeout=7",
            &[("PGCONNECT_TIMEOUT", "10")],
            &[],
        );
        assert_eq!(
            config.get_connect_timeout(),
            Some(&std::time::Duration::from_secs(7))
        );

        let (config, _) = filled(
            "postgres://db/orders",
            &[("PGAPPNAME", "orders-relay")],
            &[],
        );
        assert_eq!(config.get_application_name(), Some("orders-relay"));
        let (config, _) = filled(
            "postgres://db/orders?application_name=mine",
            &[("PGAPPNAME", "orders-relay")],
            &[],
        );
        assert_eq!(config.get_application_name(), Some("mine"));

        let attributes = |url: &str, value: &str| {
            let (config, result) = filled(url, &[("PGTARGETSESSIONATTRS", value)], &[]);
            result.map(|taken| (config.get_target_session_attrs(), taken))
        };
        assert_eq!(
            attributes("host=a,b dbname=orders", "read-write"),
            Ok((
                TargetSessionAttrs::ReadWrite,
                Some("from the environment: PGTARGETSESSIONATTRS=read-write".to_owned())
            ))
        );
        // The string's own, even the default's value, is kept.
        assert_eq!(
            attributes("host=a,b target_session_attrs=any", "read-write"),
            Ok((TargetSessionAttrs::Any, None))
        );
        assert!(
            attributes("postgres://a,b/orders", "primary")
                .unwrap_err()
                .starts_with("PGTARGETSESSIONATTRS=primary: the toolkit's connections")
        );
    }
}
