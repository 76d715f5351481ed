//! libpq's connection service file (PostgreSQL docs, "libpq: The Connection Service File"):
//! a string's `service=<name>`, else `PGSERVICE`, names a section of `key=value` settings that
//! give what the string leaves out, before the environment does. tokio-postgres, which opens
//! the toolkit's own connections, knows no `service` (it refused the option) and reads no file,
//! so a service's settings were lost: with `PGSERVICE` set, the toolkit connected where the
//! string and the environment alone led, another database than `psql`'s.
//!
//! The section is looked for, as libpq looks, in the user's file, `PGSERVICEFILE` or
//! `~/.pg_service.conf`, then in the system's, `pg_service.conf` in `PGSYSCONFDIR` or else
//! `/etc/postgresql-common` (the directory Debian's and Ubuntu's libpq are built with). Its
//! settings are written into the string where it gives none of them, so that the string's
//! own come first, then the service's, then the environment's ([`super::defaults`]).

use std::borrow::Cow;
use std::path::{Path, PathBuf};

/// The system's directory of `pg_service.conf` without `PGSYSCONFDIR`.
const SYSTEM_DIRECTORY: &str = "/etc/postgresql-common";

/// `database_url` without its `service` option and with the settings of the service it (or
/// `PGSERVICE`) names that it does not give itself ([the module](self)), and a note naming the
/// service, its file and what it gave (a password by its key alone), for the error of a
/// connection that then fails; the string as it is, and no note, without a service.
///
/// # Errors
/// A service found in neither file (libpq's words: `definition of service "x" not found`), a
/// file that cannot be read, a line that is not `key=value`, a `service` inside a service:
/// each naming the file and line.
pub(crate) fn expand(database_url: &str) -> Result<(Cow<'_, str>, Option<String>), String> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    expand_in(
        database_url,
        &|name| std::env::var(name).ok().filter(|value| !value.is_empty()),
        home.as_deref(),
    )
}

/// [`expand`], with `environment` the process's variables and `home` the user's directory.
fn expand_in<'a>(
    database_url: &'a str,
    environment: &dyn Fn(&str) -> Option<String>,
    home: Option<&Path>,
) -> Result<(Cow<'a, str>, Option<String>), String> {
    let written = Written::of(database_url);
    let Some(name) = written.service.clone().or_else(|| environment("PGSERVICE")) else {
        return Ok((Cow::Borrowed(database_url), None));
    };
    let user_file = environment("PGSERVICEFILE")
        .map(PathBuf::from)
        .or_else(|| home.map(|home| home.join(".pg_service.conf")));
    let system_file =
        Path::new(&environment("PGSYSCONFDIR").unwrap_or_else(|| SYSTEM_DIRECTORY.to_owned()))
            .join("pg_service.conf");
    let mut found = None;
    for file in user_file.iter().chain([&system_file]) {
        if let Some(settings) = section(file, &name)? {
            found = Some((file.clone(), settings));
            break;
        }
    }
    let Some((file, settings)) = found else {
        let looked: Vec<String> = user_file
            .iter()
            .chain([&system_file])
            .map(|file| file.display().to_string())
            .collect();
        return Err(format!(
            "definition of service \"{name}\" not found (looked in {})",
            looked.join(" and ")
        ));
    };
    let mut text = written.without_service(database_url);
    let mut gave = Vec::new();
    let mut taken: Vec<String> = Vec::new();
    for (key, value) in settings {
        // The string's own first; of a key the section gives twice, its first (libpq: "don't
        // override any previous explicit setting").
        if written.gives(&key) || taken.contains(&key) {
            continue;
        }
        taken.push(key.clone());
        gave.push(if key.contains("password") {
            key.clone()
        } else {
            format!("{key}={value}")
        });
        written.append(&mut text, &key, &value);
    }
    let note = format!(
        "service {name} of {}: {}",
        file.display(),
        if gave.is_empty() {
            "nothing the string does not give".to_owned()
        } else {
            gave.join(", ")
        }
    );
    Ok((Cow::Owned(text), Some(note)))
}

/// The settings of section `[name]` of the service file `file`, in its order; `None` where the
/// file does not exist or has no such section.
fn section(file: &Path, name: &str) -> Result<Option<Vec<(String, String)>>, String> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => {
            return Err(format!(
                "service file {}: cannot be read: {error}",
                file.display()
            ));
        }
    };
    let mut settings: Option<Vec<(String, String)>> = None;
    let mut inside = false;
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(section) = line.strip_prefix('[') {
            if inside {
                break;
            }
            inside = section.strip_suffix(']') == Some(name);
            if inside {
                settings = Some(Vec::new());
            }
            continue;
        }
        if !inside {
            continue;
        }
        let at = || format!("service file {}, line {}", file.display(), number + 1);
        let Some((key, value)) = line.split_once('=') else {
            return Err(format!("{}: not a `key=value` setting", at()));
        };
        let key = key.trim();
        if key == "service" {
            return Err(format!(
                "{}: a service inside a service is not followed (nor by libpq)",
                at()
            ));
        }
        if let Some(settings) = settings.as_mut() {
            settings.push((key.to_owned(), value.trim().to_owned()));
        }
    }
    Ok(settings)
}

/// What a connection string gives itself: its `service`, where that is written, and the keys
/// it sets.
pub(super) struct Written {
    /// A `postgres://` URL (else a `key=value` string).
    url: bool,
    pub(super) service: Option<String>,
    /// The byte ranges of every `service` pair.
    service_at: Vec<std::ops::Range<usize>>,
    /// The keys the string sets: its options, and of a URL what its user information, hosts
    /// and path give.
    keys: Vec<String>,
}

impl Written {
    pub(super) fn of(database_url: &str) -> Self {
        let (form, pairs) = super::tls::pairs(database_url);
        let mut written = Self {
            url: matches!(form, super::tls::Form::Url { .. }),
            service: None,
            service_at: Vec::new(),
            keys: Vec::new(),
        };
        if written.url {
            written.url_keys(database_url.split('?').next().unwrap_or_default());
        }
        for pair in pairs {
            written.key(&pair.key, pair.value, pair.at);
        }
        written
    }

    fn key(&mut self, key: &str, value: String, pair: std::ops::Range<usize>) {
        if key == "service" {
            self.service = Some(value);
            self.service_at.push(pair);
        } else {
            self.keys.push(key.to_owned());
        }
    }

    /// The keys the part of a URL before its query gives:
    /// `postgres://user:password@host:port/dbname`.
    fn url_keys(&mut self, base: &str) {
        let rest = base
            .split_once("://")
            .map_or(base, |(_, rest)| rest)
            .to_owned();
        let (authority, path) = rest.split_once('/').unwrap_or((&rest, ""));
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        if let Some(userinfo) = userinfo {
            let (user, password) = userinfo
                .split_once(':')
                .map_or((userinfo, None), |(user, password)| (user, Some(password)));
            if !user.is_empty() {
                self.keys.push("user".to_owned());
            }
            if password.is_some() {
                self.keys.push("password".to_owned());
            }
        }
        for host in hosts.split(',') {
            // `[::1]:5433`, `db:5433`, `:5433`: a host before the last `:` outside brackets.
            let (host, port) = match host.rfind(':').filter(|at| !host[*at..].contains(']')) {
                Some(at) => (&host[..at], &host[at + 1..]),
                None => (host, ""),
            };
            if !host.is_empty() {
                self.keys.push("host".to_owned());
            }
            if !port.is_empty() {
                self.keys.push("port".to_owned());
            }
        }
        if !path.is_empty() {
            self.keys.push("dbname".to_owned());
        }
    }

    /// Whether the string sets `key` itself.
    pub(super) fn gives(&self, key: &str) -> bool {
        self.keys.iter().any(|given| given == key)
    }

    /// `database_url` without its `service` pairs.
    pub(super) fn without_service(&self, database_url: &str) -> String {
        let mut text = database_url.to_owned();
        for pair in self.service_at.iter().rev() {
            let mut range = pair.clone();
            // The pair's separator too: the `&` (or the `?`'s next pair's) or the space.
            if range.end < text.len() {
                range.end += 1;
            } else if range.start > 0 {
                range.start -= 1;
            }
            text.replace_range(range, "");
        }
        if self.url && (text.ends_with('?') || text.ends_with('&')) {
            text.pop();
        }
        if !self.url {
            text = text.trim().to_owned();
        }
        text
    }

    /// Writes `key=value` into `text`, a URL's query pair or a quoted `key=value` pair.
    fn append(&self, text: &mut String, key: &str, value: &str) {
        if self.url {
            text.push(if text.contains('?') { '&' } else { '?' });
            text.push_str(key);
            text.push('=');
            text.extend(percent_encoding::utf8_percent_encode(
                value,
                percent_encoding::NON_ALPHANUMERIC,
            ));
        } else {
            if !text.trim_end().is_empty() {
                text.push(' ');
            }
            text.push_str(key);
            text.push_str("='");
            for c in value.chars() {
                if c == '\'' || c == '\\' {
                    text.push('\\');
                }
                text.push(c);
            }
            text.push('\'');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Files {
        dir: PathBuf,
    }

    impl Files {
        fn new(user: &str, system: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "outbox-service-{}-{}",
                std::process::id(),
                uuid::Uuid::new_v4().simple()
            ));
            std::fs::create_dir_all(dir.join("etc")).unwrap();
            std::fs::write(dir.join(".pg_service.conf"), user).unwrap();
            std::fs::write(dir.join("etc").join("pg_service.conf"), system).unwrap();
            Self { dir }
        }

        fn expanded(
            &self,
            url: &str,
            environment: &[(&str, &str)],
        ) -> Result<(String, Option<String>), String> {
            let system = self.dir.join("etc").display().to_string();
            expand_in(
                url,
                &|name| {
                    crate::environment_of(environment)(name)
                        .or_else(|| (name == "PGSYSCONFDIR").then(|| system.clone()))
                },
                Some(&self.dir),
            )
            .map(|(text, note)| (text.into_owned(), note))
        }
    }

    impl Drop for Files {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    const USER: &str = "# the user's\n\
                        [orders]\n\
                        host=db.internal\n\
                        host=not-this-one\n\
                        port = 5433\n\
                        dbname=orders\n\
                        user=app\n\
                        password=it's s3cret\n\
                        sslmode=verify-full\n\
                        \n\
                        [other]\n\
                        host=elsewhere\n";

    #[test]
    fn a_service_gives_what_the_string_leaves_out_and_nothing_it_gives() {
        let files = Files::new(USER, "[orders]\nhost=system\n");
        let (url, note) = files.expanded("postgres:///?service=orders", &[]).unwrap();
        assert_eq!(
            url,
            "postgres:///?host=db%2Einternal&port=5433&dbname=orders&user=app\
             &password=it%27s%20s3cret&sslmode=verify%2Dfull"
        );
        // As the connection reads it: `verify-full` is the TLS module's to take.
        let config: tokio_postgres::Config = super::super::tls::parsable(&url).parse().unwrap();
        assert_eq!(config.get_password(), Some(&b"it's s3cret"[..]));
        assert_eq!(
            config.get_hosts(),
            [tokio_postgres::config::Host::Tcp("db.internal".to_owned())]
        );
        assert_eq!(config.get_ports(), [5433]);
        assert_eq!(
            note.unwrap(),
            format!(
                "service orders of {}: host=db.internal, port=5433, dbname=orders, user=app, \
                 password, sslmode=verify-full",
                files.dir.join(".pg_service.conf").display()
            )
        );
        // The string's own come first.
        let (url, _) = files
            .expanded(
                "postgres://me:pw@[::1]:6000/mine?sslmode=disable&service=orders",
                &[],
            )
            .unwrap();
        assert_eq!(url, "postgres://me:pw@[::1]:6000/mine?sslmode=disable");
        let (text, _) = files
            .expanded("service=orders  dbname=mine user='o\\'brien'", &[])
            .unwrap();
        assert_eq!(
            text,
            "dbname=mine user='o\\'brien' host='db.internal' port='5433' \
             password='it\\'s s3cret' sslmode='verify-full'"
        );
        let config: tokio_postgres::Config = super::super::tls::parsable(&text).parse().unwrap();
        assert_eq!(config.get_user(), Some("o'brien"));
        assert_eq!(config.get_dbname(), Some("mine"));
    }

    #[test]
    fn pgservice_names_it_where_the_string_does_not_and_the_user_file_comes_first() {
        let files = Files::new(
            USER,
            "[orders]\nhost=system\n[audit]\nhost=audit.internal\n",
        );
        let (url, _) = files
            .expanded("postgres://", &[("PGSERVICE", "orders")])
            .unwrap();
        assert!(url.starts_with("postgres://?host=db%2Einternal&"), "{url}");
        let (url, note) = files
            .expanded("postgres://?service=audit", &[("PGSERVICE", "orders")])
            .unwrap();
        assert_eq!(url, "postgres://?host=audit%2Einternal");
        assert!(
            note.unwrap()
                .contains("/etc/pg_service.conf: host=audit.internal")
        );
        let elsewhere = files.dir.join("elsewhere.conf");
        std::fs::write(&elsewhere, "[orders]\nhost=from-pgservicefile\n").unwrap();
        let (url, _) = files
            .expanded(
                "postgres://",
                &[
                    ("PGSERVICE", "orders"),
                    ("PGSERVICEFILE", elsewhere.to_str().unwrap()),
                ],
            )
            .unwrap();
        assert_eq!(url, "postgres://?host=from%2Dpgservicefile");
        // Without a service, the string as it is.
        assert_eq!(
            files.expanded("postgres://db/orders?sslmode=require", &[]),
            Ok(("postgres://db/orders?sslmode=require".to_owned(), None))
        );
    }

    #[test]
    fn a_service_not_found_or_badly_written_is_named() {
        let files = Files::new("[orders]\nhost\n", "[nested]\nservice=orders\n");
        let user = files.dir.join(".pg_service.conf").display().to_string();
        let system = files.dir.join("etc/pg_service.conf").display().to_string();
        assert_eq!(
            files.expanded("service=missing", &[]),
            Err(format!(
                "definition of service \"missing\" not found (looked in {user} and {system})"
            ))
        );
        assert_eq!(
            files.expanded("postgres://?service=orders", &[]),
            Err(format!(
                "service file {user}, line 2: not a `key=value` setting"
            ))
        );
        assert_eq!(
            files.expanded("postgres://?service=nested", &[]),
            Err(format!(
                "service file {system}, line 2: a service inside a service is not followed \
                 (nor by libpq)"
            ))
        );
    }
}
