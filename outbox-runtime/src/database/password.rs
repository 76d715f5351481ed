//! The password of a PostgreSQL connection string that gives none, found where libpq finds
//! it (PostgreSQL docs, "libpq: Environment Variables" and "libpq: The Password File"):
//!
//! - `PGPASSWORD`, as if the string gave it;
//! - else the password file, the string's `passfile`, `PGPASSFILE` or `~/.pgpass`: lines of
//!   `hostname:port:database:username:password`, the first four matched against the
//!   connection's (each may be `*`), the first matching line winning; `\:` and `\\` stand for
//!   `:` and `\`; lines that start with `#` are comments. A connection over a Unix socket
//!   matches its directory, else `localhost`; with several hosts, the first host that has a
//!   line gives it.
//!   As libpq does, a file that its group or others may read is ignored: its permissions
//!   must be `u=rw` (0600) or less; a connection that then fails for want of a password says
//!   so.
//!
//! A deployment keeps the password out of the URL this way, which travels in environment
//! variables, process listings and configuration; tokio-postgres reads neither of them.

use std::path::{Path, PathBuf};

/// What a password file's line is matched against: one host of the connection.
#[derive(Debug, PartialEq, Eq)]
struct Target<'a> {
    host: &'a str,
    port: u16,
    database: &'a str,
    user: &'a str,
}

/// Gives `config` the password libpq would use where it has none, from the process's
/// environment and the password file; returns why the password file was ignored, for the
/// error of a connection that then fails.
pub(crate) fn fill(config: &mut tokio_postgres::Config, passfile: Option<&str>) -> Option<String> {
    if config.get_password().is_some() {
        return None;
    }
    let environment = |name: &str| match (name, passfile) {
        // The string's option comes before the environment's (libpq's order).
        ("PGPASSFILE", Some(passfile)) => Some(passfile.to_owned()),
        _ => std::env::var(name).ok().filter(|value| !value.is_empty()),
    };
    let home = std::env::var_os("HOME").map(PathBuf::from);
    match find(config, &environment, home.as_deref()) {
        Ok(Some(password)) => {
            config.password(password);
            None
        }
        Ok(None) => None,
        Err(ignored) => Some(ignored),
    }
}

/// The password for `config` ([`fill`]), with `environment` the process's variables and
/// `home` the directory of the default `.pgpass`; or why the password file was ignored.
fn find(
    config: &tokio_postgres::Config,
    environment: &dyn Fn(&str) -> Option<String>,
    home: Option<&Path>,
) -> Result<Option<String>, String> {
    if let Some(password) = environment("PGPASSWORD") {
        return Ok(Some(password));
    }
    let Some(user) = config.get_user() else {
        return Ok(None);
    };
    let Some(file) = environment("PGPASSFILE")
        .map(PathBuf::from)
        .or_else(|| home.map(|home| home.join(".pgpass")))
    else {
        return Ok(None);
    };
    let Some(text) = readable(&file)? else {
        return Ok(None);
    };
    let database = config.get_dbname().unwrap_or(user);
    let ports = config.get_ports();
    Ok(config
        .get_hosts()
        .iter()
        .enumerate()
        .find_map(|(index, host)| {
            let port = ports.get(index).or(ports.first()).copied().unwrap_or(5432);
            let names = match host {
                tokio_postgres::config::Host::Tcp(name) => vec![name.clone()],
                // Its directory as written, else `localhost`, which libpq matches with its
                // default socket directory (the docs' "The Password File").
                #[cfg(unix)]
                tokio_postgres::config::Host::Unix(path) => {
                    vec![path.to_string_lossy().into_owned(), "localhost".to_owned()]
                }
            };
            names.iter().find_map(|host| {
                lookup(
                    &text,
                    &Target {
                        host,
                        port,
                        database,
                        user,
                    },
                )
            })
        }))
}

/// The text of the password file `file`, or `None` where it is missing or unreadable; why it
/// is ignored where its group or others may read it, as libpq ignores it.
fn readable(file: &Path) -> Result<Option<String>, String> {
    let Ok(metadata) = std::fs::metadata(file) else {
        return Ok(None);
    };
    if !metadata.is_file() {
        return Ok(None);
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "the password file {} was ignored: it has group or world access (mode {mode:o}), \
                 and its permissions should be u=rw (0600) or less, as libpq asks",
                file.display()
            ));
        }
    }
    Ok(std::fs::read_to_string(file).ok())
}

/// The password of the first line of the password file `text` that matches `target`.
fn lookup(text: &str, target: &Target<'_>) -> Option<String> {
    let port = target.port.to_string();
    let wanted = [target.host, port.as_str(), target.database, target.user];
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .find_map(|line| {
            let fields = fields(line);
            let [host, port, database, user, password] = fields.as_slice() else {
                return None;
            };
            [host, port, database, user]
                .into_iter()
                .zip(wanted)
                .all(|(field, wanted)| field == "*" || field == wanted)
                .then(|| password.clone())
        })
}

/// The `:`-separated fields of a password file's line, `\:` and `\\` read as `:` and `\`;
/// the fifth field takes the rest of the line, as libpq reads it.
fn fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    fields.last_mut().expect("a field").push(next);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields.last_mut().expect("a field").push(c),
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> tokio_postgres::Config {
        url.parse().unwrap()
    }

    const FILE: &str = "# the service's databases\n\
        db.internal:5432:orders:app:first\\:one\n\
        db.internal:*:orders:app:not-this\n\
        *:*:*:relay:relay\\\\pw:with:colons\n\
        localhost:5433:*:app:local\n\
        /run/pg-other:5433:*:app:by-directory\n\
        broken line\n";

    #[test]
    fn the_first_line_that_matches_gives_the_password() {
        let target = |host, port, database, user| Target {
            host,
            port,
            database,
            user,
        };
        for (target, password) in [
            (
                target("db.internal", 5432, "orders", "app"),
                Some("first:one"),
            ),
            (
                target("db.internal", 6432, "orders", "app"),
                Some("not-this"),
            ),
            (
                target("other", 1, "any", "relay"),
                Some("relay\\pw:with:colons"),
            ),
            (target("localhost", 5433, "billing", "app"), Some("local")),
            (target("db.internal", 5432, "billing", "app"), None),
            (target("broken line", 5432, "orders", "app"), None),
        ] {
            assert_eq!(lookup(FILE, &target).as_deref(), password, "{target:?}");
        }
    }

    #[test]
    fn pgpassword_then_the_password_file_give_a_password_the_string_does_not() {
        let dir = std::env::temp_dir().join(format!("outbox-pgpass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pgpass");
        std::fs::write(&file, FILE).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let path = file.to_str().unwrap().to_owned();
        let with_file = |name: &str| (name == "PGPASSFILE").then(|| path.clone());
        let url = "postgres://app@db.internal/orders";
        for (string, password) in [
            (url, "first:one"),
            // The second host has a line where the first has none.
            (
                "postgres://app@elsewhere:5444,localhost:5433/billing",
                "local",
            ),
            // A Unix socket: its directory, else `localhost`.
            (
                "host=/run/postgresql port=5433 user=app dbname=billing",
                "local",
            ),
            (
                "host=/run/pg-other port=5433 user=app dbname=billing",
                "by-directory",
            ),
        ] {
            assert_eq!(
                find(&config(string), &with_file, None).unwrap().as_deref(),
                Some(password),
                "{string}"
            );
        }
        // `PGPASSWORD` comes first.
        let both = |name: &str| match name {
            "PGPASSWORD" => Some("from-the-environment".to_owned()),
            other => with_file(other),
        };
        assert_eq!(
            find(&config(url), &both, None).unwrap().as_deref(),
            Some("from-the-environment")
        );
        // `~/.pgpass` without `PGPASSFILE`.
        std::fs::copy(&file, dir.join(".pgpass")).unwrap();
        assert_eq!(
            find(&config(url), &|_| None, Some(&dir))
                .unwrap()
                .as_deref(),
            Some("first:one")
        );
        // A file its group may read is ignored, as libpq ignores it.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
            let ignored = find(&config(url), &with_file, None).unwrap_err();
            assert!(ignored.contains("(mode 640)"), "{ignored}");
        }
        // No user, no line to match.
        assert_eq!(
            find(&config("host=db.internal dbname=orders"), &with_file, None),
            Ok(None)
        );
        // A password in the string is kept.
        let mut given = config("postgres://app:in-the-url@db.internal/orders");
        assert_eq!(fill(&mut given, None), None);
        assert_eq!(given.get_password(), Some(&b"in-the-url"[..]));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
