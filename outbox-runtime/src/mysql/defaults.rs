//! A MySQL URL read as diesel's own `MysqlConnection` reads it (its options, and what
//! libmysqlclient takes for what the URL leaves out), rewritten in mysql_async's terms, so
//! that the URL a service's diesel connections take also connects the toolkit's own, which
//! mysql_async opens and which knows none of diesel's options and reads no environment:
//!
//! - no host (`mysql:///orders`): `localhost`, the server on this host (MySQL C API docs,
//!   `mysql_real_connect()`: "If host is NULL or the string "localhost", a connection to the
//!   local host is assumed"); mysql_async refused such a URL ("Invalid or incomplete
//!   connection URL");
//! - `unix_socket=<path>` (diesel's option), with the host `localhost` or none: that socket
//!   (mysql_async's `socket`); with another host, libmysqlclient connects over TCP to that host
//!   and ignores the socket, and so does the toolkit. Without either, and with the host
//!   `localhost` or none, `MYSQL_UNIX_PORT`'s socket where it is set;
//! - no port: `MYSQL_TCP_PORT`, else 3306;
//! - no user: the operating system's (the C API's "the current login name");
//! - no password: `MYSQL_PWD` (MySQL 8.0 docs, 6.9 "Environment Variables"; an insecure place
//!   for a password, but where libmysqlclient looks);
//! - `ssl_mode=<mode>` (diesel's option, the values of MySQL's `--ssl-mode`, in any case):
//!   `disabled`: no TLS; `preferred`: as without it (no TLS, mysql_async's default, unless
//!   `ssl_ca`, `ssl_cert` or `ssl_key` asks for it; libmysqlclient's `preferred` would try
//!   TLS first, without checking the server's certificate, and go on without it); `required`:
//!   TLS, the server's certificate not checked (MySQL 8.0 docs, "Command Options for
//!   Encrypted Connections", `--ssl-mode`) unless `ssl_ca` is given, as libpq's `require`
//!   with a root certificate, and then as `verify_ca`; `verify_ca`: TLS, the certificate
//!   chained to `ssl_ca`'s authorities (else the public ones), its name not asked for
//!   (mysql_async's `verify_identity=false`, which on rustls checks the name nonetheless:
//!   mysql_async issue 404, which the error of a wrong name names); `verify_identity`: TLS,
//!   the chain and the name checked. Two answers to one question are refused: `disabled`
//!   beside `ssl_ca`, `ssl_cert` or `ssl_key`, and any mode beside mysql_async's own
//!   `require_ssl`, `verify_ca` or `verify_identity`.
//!
//! A value the URL gives is never replaced, and a URL that needs none of this is used as it is.

use std::fmt::Write as _;

/// A URL rewritten for mysql_async ([the module](self)), and what it took from elsewhere.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Completed {
    /// The URL mysql_async is given.
    pub(super) url: String,
    /// What the rewriting took that the URL does not say, for the error of a connection that
    /// then fails: the variables read (`MYSQL_PWD`'s value never), and a host defaulted.
    pub(super) taken: Option<String>,
}

/// The TLS mysql_async's options give for each `ssl_mode` ([the module](self)): its name,
/// and whether TLS is asked for, the certificate's chain checked (`None`: only with `ssl_ca`),
/// and its name checked.
const SSL_MODES: [(&str, bool, Option<bool>, bool); 5] = [
    ("disabled", false, None, false),
    ("preferred", false, None, false),
    ("required", true, None, false),
    ("verify_ca", true, Some(true), false),
    ("verify_identity", true, Some(true), true),
];

/// Rewrites `database_url` for mysql_async ([the module](self)), reading the process's
/// environment and user.
///
/// # Errors
/// A `ssl_mode` that is not one of MySQL's, or beside mysql_async's own TLS options;
/// `unix_socket` beside `socket`; a `MYSQL_TCP_PORT` that is not a port number: each named.
pub(super) fn complete(database_url: &str) -> Result<Completed, String> {
    complete_from(
        database_url,
        &|name| std::env::var(name).ok().filter(|value| !value.is_empty()),
        &|| whoami::username().ok(),
    )
}

/// [`complete`], with `environment` the process's variables and `login` the operating
/// system's user.
fn complete_from(
    database_url: &str,
    environment: &dyn Fn(&str) -> Option<String>,
    login: &dyn Fn() -> Option<String>,
) -> Result<Completed, String> {
    let unchanged = || Completed {
        url: database_url.to_owned(),
        taken: None,
    };
    // What does not parse, or is not MySQL's, is left to mysql_async, whose error names it.
    let Ok(mut url) = url::Url::parse(database_url) else {
        return Ok(unchanged());
    };
    if url.scheme() != "mysql" || url.cannot_be_a_base() {
        return Ok(unchanged());
    }
    let mut changed = false;
    let mut taken = Vec::new();
    let mut take = |name: &'static str, shown: bool| {
        let value = environment(name)?;
        taken.push(if shown {
            format!("{name}={value}")
        } else {
            name.to_owned()
        });
        Some(value)
    };

    // The query's pairs as written (their encoding kept: the TLS files' paths are read from
    // them again), and diesel's options taken out of them.
    let query = url.query().unwrap_or_default().to_owned();
    let mut pairs: Vec<String> = query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(str::to_owned)
        .collect();
    let mut option = |name: &str| -> Option<String> {
        let index = pairs.iter().position(|pair| {
            pair.split_once('=')
                .map_or(pair.as_str(), |(key, _)| key)
                .eq(name)
        })?;
        let pair = pairs.remove(index);
        let value = pair.split_once('=').map_or("", |(_, value)| value);
        Some(
            percent_encoding::percent_decode_str(value)
                .decode_utf8_lossy()
                .into_owned(),
        )
    };
    let ssl_mode = option("ssl_mode");
    let unix_socket = option("unix_socket");
    // Whether the query (diesel's options taken out) gives the option `name`.
    let has = |name: &str| {
        pairs
            .iter()
            .any(|pair| pair.split_once('=').map_or(pair.as_str(), |(key, _)| key) == name)
    };
    let socket_given = has("socket");
    let tls_options: Vec<&str> = ["require_ssl", "verify_ca", "verify_identity"]
        .into_iter()
        .filter(|name| has(name))
        .collect();
    let ssl_ca_given = has("ssl_ca");
    let tls_file = ["ssl_ca", "ssl_cert", "ssl_key"]
        .into_iter()
        .find(|name| has(name));

    let defaulted = match url.host_str() {
        None | Some("") => {
            url.set_host(Some("localhost"))
                .map_err(|error| format!("the URL's host: {error}"))?;
            changed = true;
            Some("no host in the URL: localhost, as libmysqlclient")
        }
        Some(_) => None,
    };
    let local = url.host_str() == Some("localhost");

    let mut added = Vec::new();
    if let Some(path) = unix_socket {
        changed = true;
        if socket_given {
            return Err(
                "both unix_socket and socket are given: the one socket, once (unix_socket is \
                 diesel's name, socket mysql_async's)"
                    .to_owned(),
            );
        }
        if local {
            added.push(("socket", path));
        }
    } else if local
        && !socket_given
        && let Some(path) = take("MYSQL_UNIX_PORT", true)
    {
        changed = true;
        added.push(("socket", path));
    }

    if url.port().is_none()
        && let Some(port) = take("MYSQL_TCP_PORT", true)
    {
        let number = port
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|number| *number > 0)
            .ok_or_else(|| {
                format!("MYSQL_TCP_PORT={port}: `{port}` is not a port number (1 to 65535)")
            })?;
        changed = true;
        let _ = url.set_port(Some(number));
    }
    // Encoded here: the URL's own encoding of the user information leaves a `%` as it is,
    // which mysql_async then decodes (`p%41ss` would log in as `pAss`).
    let userinfo =
        |text: &str| percent_encoding::utf8_percent_encode(text, QUERY_VALUE).to_string();
    if url.username().is_empty()
        && let Some(user) = login()
    {
        changed = true;
        let _ = url.set_username(&userinfo(&user));
    }
    if url.password().is_none()
        && let Some(password) = take("MYSQL_PWD", false)
    {
        changed = true;
        let _ = url.set_password(Some(&userinfo(&password)));
    }

    if let Some(mode) = ssl_mode {
        changed = true;
        let Some(&(_, tls, chain, name)) = SSL_MODES
            .iter()
            .find(|(known, ..)| known.eq_ignore_ascii_case(&mode))
        else {
            let known: Vec<&str> = SSL_MODES.iter().map(|(known, ..)| *known).collect();
            return Err(format!(
                "ssl_mode={mode}: not one of {} (MySQL's --ssl-mode)",
                known.join(", ")
            ));
        };
        if let Some(given) = tls_options.first() {
            return Err(format!(
                "ssl_mode={mode} and {given} are both given: say which TLS with one of them \
                 (ssl_mode is diesel's, {given} mysql_async's)"
            ));
        }
        if let Some(file) = tls_file.filter(|_| !tls && mode.eq_ignore_ascii_case("disabled")) {
            return Err(format!(
                "ssl_mode={mode} and {file} are both given: {file} is for TLS, which \
                 ssl_mode={mode} turns off"
            ));
        }
        if tls {
            added.push(("require_ssl", "true".to_owned()));
            if !chain.unwrap_or(ssl_ca_given) {
                added.push(("verify_ca", "false".to_owned()));
            }
            if !name {
                added.push(("verify_identity", "false".to_owned()));
            }
        }
    }

    if !changed {
        return Ok(unchanged());
    }
    let mut query = pairs.join("&");
    for (name, value) in added {
        if !query.is_empty() {
            query.push('&');
        }
        let value = percent_encoding::utf8_percent_encode(&value, QUERY_VALUE);
        let _ = write!(query, "{name}={value}");
    }
    url.set_query((!query.is_empty()).then_some(query.as_str()));
    let mut notes = Vec::new();
    if !taken.is_empty() {
        notes.push(format!("from the environment: {}", taken.join(", ")));
    }
    notes.extend(defaulted.map(str::to_owned));
    Ok(Completed {
        url: url.into(),
        taken: (!notes.is_empty()).then(|| notes.join("; ")),
    })
}

/// What a value added to the URL is percent-encoded for: all but the unreserved characters
/// (RFC 3986, 2.3) and `/`, which a path keeps readable.
const QUERY_VALUE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'/');

#[cfg(test)]
mod tests {
    use super::*;

    fn completed(url: &str, environment: &[(&str, &str)]) -> Result<Completed, String> {
        complete_from(url, &crate::environment_of(environment), &|| {
            Some("login".to_owned())
        })
    }

    fn url(url: &str, environment: &[(&str, &str)]) -> String {
        completed(url, environment).unwrap().url
    }

    #[test]
    fn a_url_that_needs_nothing_is_used_as_it_is() {
        for given in [
            "mysql://app:pw@db.internal:3306/orders",
            "mysql://app@127.0.0.1/orders?ssl_ca=/etc/ca%20bundle.pem&prefer_socket=false",
            "postgres://host/db",
            "mysql://app@/orders",
            "not a url",
        ] {
            assert_eq!(
                completed(given, &[]),
                Ok(Completed {
                    url: given.to_owned(),
                    taken: None
                }),
                "{given}"
            );
        }
    }

    #[test]
    fn what_the_url_leaves_out_comes_from_the_environment_and_the_login() {
        let environment = [
            ("MYSQL_TCP_PORT", "3307"),
            ("MYSQL_PWD", "s3cret"),
            ("MYSQL_UNIX_PORT", "/run/my sql.sock"),
        ];
        let all = completed("mysql:///orders", &environment).unwrap();
        assert_eq!(
            all.url,
            "mysql://login:s3cret@localhost:3307/orders?socket=/run/my%20sql.sock"
        );
        assert_eq!(
            all.taken.as_deref(),
            Some(
                "from the environment: MYSQL_UNIX_PORT=/run/my sql.sock, MYSQL_TCP_PORT=3307, \
                 MYSQL_PWD; no host in the URL: localhost, as libmysqlclient"
            )
        );
        // Given, never replaced; a remote host takes no local socket.
        let given = completed("mysql://app:pw@db.internal:3306/orders", &environment).unwrap();
        assert_eq!(given.url, "mysql://app:pw@db.internal:3306/orders");
        assert_eq!(given.taken, None);
        assert_eq!(
            url("mysql://app@localhost/orders?socket=/s", &environment),
            "mysql://app:s3cret@localhost:3307/orders?socket=/s"
        );
        assert_eq!(
            url("mysql:///orders", &[]),
            "mysql://login@localhost/orders"
        );
        assert_eq!(
            completed("mysql://app@h/orders", &[("MYSQL_TCP_PORT", "33o6")]),
            Err("MYSQL_TCP_PORT=33o6: `33o6` is not a port number (1 to 65535)".to_owned())
        );
    }

    #[test]
    fn a_password_and_a_user_from_elsewhere_reach_the_driver_as_they_are() {
        for odd in ["p%41ss", "p@ss:w/rd#?&=", "pässwörd", "100%"] {
            let completed = complete_from(
                "mysql://db.internal/orders",
                &|name| (name == "MYSQL_PWD").then(|| odd.to_owned()),
                &|| Some(odd.to_owned()),
            )
            .unwrap();
            let opts = mysql_async::Opts::from_url(&completed.url).unwrap();
            assert_eq!(
                (opts.user(), opts.pass()),
                (Some(odd), Some(odd)),
                "{completed:?}"
            );
            assert_eq!(opts.ip_or_hostname(), "db.internal");
            assert_eq!(opts.db_name(), Some("orders"));
        }
    }

    #[test]
    fn diesels_unix_socket_is_mysql_asyncs_socket_for_the_local_server_alone() {
        assert_eq!(
            url(
                "mysql://app@localhost:1/orders?unix_socket=%2Frun%2Fmysqld%2Fmysqld.sock",
                &[]
            ),
            "mysql://app@localhost:1/orders?socket=/run/mysqld/mysqld.sock"
        );
        assert_eq!(
            url("mysql:///orders?unix_socket=/s&ssl_ca=/ca.pem", &[]),
            "mysql://login@localhost/orders?ssl_ca=/ca.pem&socket=/s"
        );
        assert_eq!(
            url("mysql://app@db.internal/orders?unix_socket=/s", &[]),
            "mysql://app@db.internal/orders"
        );
        assert!(
            completed("mysql://app@localhost/orders?unix_socket=/a&socket=/b", &[])
                .unwrap_err()
                .starts_with("both unix_socket and socket are given")
        );
    }

    #[test]
    fn ssl_mode_asks_mysql_async_for_the_tls_it_names() {
        let tls = |options: &str| url(&format!("mysql://app@db/orders?{options}"), &[]);
        assert_eq!(tls("ssl_mode=DISABLED"), "mysql://app@db/orders");
        assert_eq!(tls("ssl_mode=preferred&a=1"), "mysql://app@db/orders?a=1");
        assert_eq!(
            tls("ssl_mode=required"),
            "mysql://app@db/orders?require_ssl=true&verify_ca=false&verify_identity=false"
        );
        assert_eq!(
            tls("ssl_mode=required&ssl_ca=/ca.pem"),
            "mysql://app@db/orders?ssl_ca=/ca.pem&require_ssl=true&verify_identity=false"
        );
        assert_eq!(
            tls("ssl_mode=Verify_CA"),
            "mysql://app@db/orders?require_ssl=true&verify_identity=false"
        );
        assert_eq!(
            tls("ssl_mode=verify_identity&ssl_ca=/ca.pem"),
            "mysql://app@db/orders?ssl_ca=/ca.pem&require_ssl=true"
        );
        assert_eq!(
            completed("mysql://app@db/orders?ssl_mode=require", &[]),
            Err(
                "ssl_mode=require: not one of disabled, preferred, required, verify_ca, \
                 verify_identity (MySQL's --ssl-mode)"
                    .to_owned()
            )
        );
        assert_eq!(
            completed(
                "mysql://app@db/orders?ssl_mode=disabled&ssl_cert=/c.pem",
                &[]
            ),
            Err(
                "ssl_mode=disabled and ssl_cert are both given: ssl_cert is for TLS, which \
                 ssl_mode=disabled turns off"
                    .to_owned()
            )
        );
        assert_eq!(
            completed(
                "mysql://app@db/orders?verify_ca=false&ssl_mode=verify_ca",
                &[]
            ),
            Err(
                "ssl_mode=verify_ca and verify_ca are both given: say which TLS with one of \
                 them (ssl_mode is diesel's, verify_ca mysql_async's)"
                    .to_owned()
            )
        );
    }
}
