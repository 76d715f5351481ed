//! Connecting to NATS from a URL that may carry credentials.
//!
//! async-nats takes credentials from its [`ConnectOptions`] only: a user and password, or a
//! token, written in the URL (`nats://user:password@host:4222`, `nats://token@host:4222`) are
//! ignored, and the URL, credentials included, is written to its DEBUG log. [`connect`] reads
//! the credentials out of the URL, hands them to async-nats as options, and gives async-nats
//! the URL without them, so they work and are never logged. [`redacted`] is the URL as it may
//! be shown.

use std::str::FromStr;
use std::time::Duration;

use async_nats::{ConnectOptions, ServerAddr};
use percent_encoding::percent_decode_str;

/// The NATS connection could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("cannot connect to NATS at {servers}: {reason}")]
pub struct NatsConnectError {
    /// The servers, without credentials.
    pub servers: String,
    /// What went wrong.
    pub reason: String,
}

/// Credentials read from a URL.
#[derive(Clone, PartialEq, Eq)]
enum Credentials {
    None,
    Token(String),
    UserPassword(String, String),
}

/// The servers of `urls` (one URL, or several separated by commas, for a cluster) without
/// their credentials, and the credentials, which must be the same in every URL that has some.
fn parse(urls: &str) -> Result<(Vec<ServerAddr>, Credentials), String> {
    let mut servers = Vec::new();
    let mut credentials = Credentials::None;
    for url in urls.split(',').map(str::trim).filter(|url| !url.is_empty()) {
        let address = ServerAddr::from_str(url).map_err(|e| e.to_string())?;
        let decode = |text: &str| percent_decode_str(text).decode_utf8_lossy().into_owned();
        let these = match (address.username(), address.password()) {
            (None, _) => Credentials::None,
            (Some(user), Some(password)) => {
                Credentials::UserPassword(decode(user), decode(password))
            }
            (Some(token), None) => Credentials::Token(decode(token)),
        };
        if these != Credentials::None {
            if credentials != Credentials::None && credentials != these {
                return Err("the URLs carry different credentials; give one set".to_owned());
            }
            credentials = these;
        }
        let mut stripped = address.into_inner();
        let _ = stripped.set_username("");
        let _ = stripped.set_password(None);
        servers.push(ServerAddr::from_url(stripped).map_err(|e| e.to_string())?);
    }
    if servers.is_empty() {
        return Err("no server URL given".to_owned());
    }
    Ok((servers, credentials))
}

/// `urls` as they may be shown: each server without its credentials.
///
/// ```
/// assert_eq!(
///     outbox_runtime::nats::redacted("nats://relay:s3cret@n1:4222,nats://relay:s3cret@n2:4222"),
///     "nats://n1:4222,nats://n2:4222"
/// );
/// ```
pub fn redacted(urls: &str) -> String {
    match parse(urls) {
        Ok((servers, _)) => servers
            .into_iter()
            .map(|server| {
                server
                    .into_inner()
                    .to_string()
                    .trim_end_matches('/')
                    .to_owned()
            })
            .collect::<Vec<_>>()
            .join(","),
        Err(_) => "<a NATS URL that does not parse>".to_owned(),
    }
}

/// The options and servers to connect to `urls` with: the credentials of the URLs as
/// options, the servers without them. Add options of your own (TLS, a name) before
/// connecting with `options.connect(servers)`.
///
/// # Errors
/// [`NatsConnectError`] when a URL does not parse, or the URLs carry different credentials.
pub fn options(urls: &str) -> Result<(ConnectOptions, Vec<ServerAddr>), NatsConnectError> {
    let (servers, credentials) = parse(urls).map_err(|reason| NatsConnectError {
        servers: redacted(urls),
        reason,
    })?;
    let options = match credentials {
        Credentials::None => ConnectOptions::new(),
        Credentials::Token(token) => ConnectOptions::with_token(token),
        Credentials::UserPassword(user, password) => {
            ConnectOptions::with_user_and_password(user, password)
        }
    };
    Ok((options, servers))
}

/// Connects to `urls` (see [`options`]), within a 10 s connection timeout per attempt.
///
/// # Errors
/// [`NatsConnectError`], naming the servers without credentials: a URL that does not parse,
/// credentials the server refuses, or no server reachable.
pub async fn connect(urls: &str) -> Result<async_nats::Client, NatsConnectError> {
    let (options, servers) = options(urls)?;
    options
        .connection_timeout(Duration::from_secs(10))
        .connect(servers)
        .await
        .map_err(|e| NatsConnectError {
            servers: redacted(urls),
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_leave_the_url() {
        let (servers, credentials) = parse("nats://relay:p%40ss@127.0.0.1:4222").unwrap();
        assert_eq!(
            servers[0].clone().into_inner().as_str(),
            "nats://127.0.0.1:4222"
        );
        assert!(credentials == Credentials::UserPassword("relay".into(), "p@ss".into()));
        let (_, token) = parse("nats://t0ken@localhost").unwrap();
        assert!(token == Credentials::Token("t0ken".into()));
        let (servers, none) = parse("127.0.0.1:4222, nats://n2:4223").unwrap();
        assert_eq!(servers.len(), 2);
        assert!(none == Credentials::None);
    }

    #[test]
    fn different_credentials_and_bad_urls_are_refused_without_the_secret() {
        let error = options("nats://a:s3cretA@n1,nats://a:s3cretB@n2").unwrap_err();
        assert!(error.reason.contains("different credentials"), "{error}");
        assert!(!error.to_string().contains("s3cret"), "{error}");
        let error = options("http://a:s3cret@n1").unwrap_err();
        assert!(!error.to_string().contains("s3cret"), "{error}");
        assert_eq!(redacted("nats://a:s3cret@n1:4222"), "nats://n1:4222");
    }
}
