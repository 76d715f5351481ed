//! Connecting to NATS: from a URL that may carry credentials, or from [`NatsSettings`] that
//! name every way a server authenticates a client.
//!
//! async-nats takes credentials from its [`ConnectOptions`] only: a user and password, or a
//! token, written in the URL (`nats://user:password@host:4222`, `nats://token@host:4222`) are
//! ignored, and the URL, credentials included, is written to its DEBUG log. [`connect`] reads
//! the credentials out of the URL, hands them to async-nats as options, and gives async-nats
//! the URL without them, so they work and are never logged. [`redacted`] is the URL as it may
//! be shown. [`NatsSettings`] adds an NKey seed, a `.creds` file and TLS (a CA, a client
//! certificate), for the relay, the inbox and the `outbox` command alike.

use std::fmt;
use std::path::PathBuf;
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

/// One server URL without its credentials, and the credentials.
fn server(url: &str) -> Result<(ServerAddr, Credentials), String> {
    let address = ServerAddr::from_str(url).map_err(|e| e.to_string())?;
    let decode = |text: &str| percent_decode_str(text).decode_utf8_lossy().into_owned();
    let credentials = match (address.username(), address.password()) {
        (None, _) => Credentials::None,
        (Some(user), Some(password)) => Credentials::UserPassword(decode(user), decode(password)),
        (Some(token), None) => Credentials::Token(decode(token)),
    };
    let mut stripped = address.into_inner();
    let _ = stripped.set_username("");
    let _ = stripped.set_password(None);
    Ok((
        ServerAddr::from_url(stripped).map_err(|e| e.to_string())?,
        credentials,
    ))
}

/// A server as it may be shown: its URL without credentials, and without the `/` of an
/// empty path.
fn shown(server: &ServerAddr) -> String {
    let url = server.clone().into_inner();
    let text = url.as_str();
    match text.strip_suffix('/') {
        Some(shorter) if url.path() == "/" => shorter.to_owned(),
        _ => text.to_owned(),
    }
}

/// The server URLs of `urls`: one URL, or several separated by commas (a cluster).
fn server_urls(urls: &str) -> impl Iterator<Item = &str> {
    urls.split(',').map(str::trim).filter(|url| !url.is_empty())
}

/// The servers of `urls` (one URL, or several separated by commas, for a cluster) without
/// their credentials, and the credentials, which must be the same in every URL that has some.
/// An error names the URL at fault by its place in the list, without credentials.
fn parse(urls: &str) -> Result<(Vec<ServerAddr>, Credentials), String> {
    let mut servers = Vec::new();
    // The credentials found so far, and the place and server of the URL that gave them.
    let mut credentials: Option<(Credentials, usize, String)> = None;
    for (place, url) in server_urls(urls).enumerate().map(|(i, url)| (i + 1, url)) {
        let (address, these) =
            server(url).map_err(|error| format!("server URL {place}: {error}"))?;
        // `nats://` parses, and its connect failed on a DNS lookup of nothing.
        if address.host().is_empty() {
            return Err(format!(
                "server URL {place} ({}) has no host: give it as nats://<host>:4222",
                shown(&address)
            ));
        }
        if these != Credentials::None {
            match &credentials {
                Some((first, first_place, first_server)) if *first != these => {
                    return Err(format!(
                        "server URL {place} ({}) carries other credentials than URL \
                         {first_place} ({first_server}): give one set",
                        shown(&address)
                    ));
                }
                Some(_) => {}
                None => credentials = Some((these, place, shown(&address))),
            }
        }
        servers.push(address);
    }
    if servers.is_empty() {
        return Err("no server URL given".to_owned());
    }
    let credentials = credentials.map_or(Credentials::None, |(credentials, ..)| credentials);
    Ok((servers, credentials))
}

/// How a TLS file is read: [`read_certificates`] or [`read_private_key`].
type PemRead = fn(&std::path::Path) -> Result<(), rustls_pki_types::pem::Error>;

/// Reads a TLS file as async-nats will when it connects: `Ok` when it holds what `read` looks
/// for, else the message naming the file (`what` and its path) and its fault, `item` being
/// what it lacks.
fn check_pem(what: &str, path: &std::path::Path, item: &str, read: PemRead) -> Result<(), String> {
    use rustls_pki_types::pem::Error;
    read(path).map_err(|error| {
        let fault = match error {
            Error::NoItemsFound => {
                format!("it holds no PEM {item} (a -----BEGIN ...----- section)")
            }
            Error::Io(error) => error.to_string(),
            other => format!("it is not PEM: {other}"),
        };
        format!("{what} {}: {fault}", path.display())
    })
}

/// Every PEM certificate of `path`, as async-nats reads a CA file or a client certificate;
/// none is [`NoItemsFound`](rustls_pki_types::pem::Error::NoItemsFound).
fn read_certificates(path: &std::path::Path) -> Result<(), rustls_pki_types::pem::Error> {
    use rustls_pki_types::pem::PemObject;
    let certificates: Vec<_> =
        rustls_pki_types::CertificateDer::pem_file_iter(path)?.collect::<Result<_, _>>()?;
    if certificates.is_empty() {
        return Err(rustls_pki_types::pem::Error::NoItemsFound);
    }
    Ok(())
}

/// The first PEM private key of `path`, as async-nats reads a client key.
fn read_private_key(path: &std::path::Path) -> Result<(), rustls_pki_types::pem::Error> {
    use rustls_pki_types::pem::PemObject;
    rustls_pki_types::PrivateKeyDer::from_pem_file(path).map(drop)
}

/// Whether connecting failed because the TLS handshake was answered with something that is
/// not TLS (rustls's `InvalidMessage::InvalidContentType`, which tokio-rustls hands on inside
/// an I/O error): a server without TLS sends its plain INFO line where a server hello was due.
fn answered_in_plain_text(error: &async_nats::ConnectError) -> bool {
    use async_nats::rustls::{Error, InvalidMessage};
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<std::io::Error>())
        .and_then(std::io::Error::get_ref)
        .and_then(|inner| inner.downcast_ref::<Error>())
        .is_some_and(|error| {
            matches!(
                error,
                Error::InvalidMessage(InvalidMessage::InvalidContentType)
            )
        })
}

/// `urls` as they may be shown: each server without its credentials, one that does not parse
/// as `<a NATS URL that does not parse>`, none at all as `<no NATS URL>`.
///
/// ```
/// assert_eq!(
///     outbox_runtime::nats::redacted("nats://relay:s3cret@n1:4222,nats://relay:s3cret@n2:4222"),
///     "nats://n1:4222,nats://n2:4222"
/// );
/// ```
pub fn redacted(urls: &str) -> String {
    let text = server_urls(urls)
        .map(|url| match server(url) {
            Ok((server, _)) => shown(&server),
            Err(_) => "<a NATS URL that does not parse>".to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",");
    if text.is_empty() {
        "<no NATS URL>".to_owned()
    } else {
        text
    }
}

/// Whether a nats-server `version`, as its INFO reports it (`2.9.10`, `2.10.0-RC.1`,
/// `2.15.1`; `async_nats::Client::server_info().version`), is `major.minor` or later. A part
/// that is not a number counts as 0.
pub fn server_at_least(version: &str, major: u64, minor: u64) -> bool {
    let mut numbers = version
        .split(['.', '-'])
        .map(|part| part.parse::<u64>().unwrap_or(0));
    let found = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    found >= (major, minor)
}

/// What a JetStream API request that nothing answered means, as [`jetstream_error_text`]
/// says it: a nats-server with JetStream answers every request of its API (`$JS.API.>`),
/// an unknown stream with an error (10059), and an account without JetStream with one too
/// (10039, "JetStream not enabled for account", nats-server 2.9.10 and 2.15.1 both), so a
/// request without responders most likely reached a server that runs without JetStream
/// (started without `-js` or a `jetstream` block); one that disabled JetStream while running
/// (out of storage, say) logs why.
pub const NO_JETSTREAM: &str = "nothing answers JetStream's API at this NATS server: most \
    likely it runs without JetStream (start nats-server with -js, as the repository's \
    compose.yaml does); a server that disabled JetStream says why in its log";

/// Whether `error` is, or was caused by, a JetStream API request that nothing answered
/// (async-nats's `RequestErrorKind::NoResponders` of its JetStream context): see
/// [`NO_JETSTREAM`].
pub fn is_no_jetstream(error: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::context::{RequestError, RequestErrorKind};
    let mut cause = Some(error);
    while let Some(error) = cause {
        if error
            .downcast_ref::<RequestError>()
            .is_some_and(|request| request.kind() == RequestErrorKind::NoResponders)
        {
            return true;
        }
        cause = error.source();
    }
    false
}

/// Whether a stream lookup failed because JetStream answered that the stream does not exist
/// (API error 10059, `STREAM_NOT_FOUND`), rather than for want of an answer.
pub fn stream_not_found(error: &async_nats::jetstream::context::GetStreamError) -> bool {
    use async_nats::jetstream::{ErrorCode, context::GetStreamErrorKind};
    matches!(
        error.kind(),
        GetStreamErrorKind::JetStream(ref e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND
    )
}

/// The text of a JetStream API call's `error`: [`NO_JETSTREAM`] for a request that nothing
/// answered (async-nats's own words, "requested JetStream resource does not exist", read as
/// a missing stream), else the error's own.
pub fn jetstream_error_text(error: &(dyn std::error::Error + 'static)) -> String {
    jetstream_error_text_in(error, None)
}

/// [`jetstream_error_text`] for a request to the API of JetStream `domain` ([`jetstream_in`]):
/// one that nothing answered says that no server of that domain answers from the connected
/// one (no server of the network runs it, or the link to the servers that do is down),
/// naming the domain and its API's subjects.
pub fn jetstream_error_text_in(
    error: &(dyn std::error::Error + 'static),
    domain: Option<&str>,
) -> String {
    match domain {
        Some(domain) if is_no_jetstream(error) => format!(
            "nothing answers the API of JetStream domain {domain:?} ($JS.{domain}.API.>) at \
             this NATS server: no server it reaches runs JetStream in that domain (a leaf \
             node's link to its hub down, or the domain misspelt: a server's is its \
             configuration's jetstream.domain)"
        ),
        _ if is_no_jetstream(error) => NO_JETSTREAM.to_owned(),
        _ => error.to_string(),
    }
}

/// The JetStream API through `client`: the connected server's own (`$JS.API.>`) for `None`,
/// or for `Some(domain)` that of JetStream domain `domain` (`$JS.<domain>.API.>`), which the
/// servers of that domain answer from wherever in the NATS network the client is connected:
/// a leaf node's client reaching its hub's streams, say (NATS docs, "JetStream on Leaf
/// Nodes"). API requests are bounded by the connection's request timeout until
/// `set_timeout` sets the context's own.
pub fn jetstream_in(
    client: async_nats::Client,
    domain: Option<&str>,
) -> async_nats::jetstream::Context {
    match domain {
        Some(domain) => async_nats::jetstream::with_domain(client, domain),
        None => async_nats::jetstream::new(client),
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

/// How long one attempt to connect to a NATS server may take, the TCP connection and the
/// protocol's handshake (the server's `INFO`, the client's `CONNECT`, TLS where asked)
/// together: async-nats's `connection_timeout`, set by [`connect`] and
/// [`NatsSettings::connect`].
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to `urls` (see [`options`]), within [`CONNECT_TIMEOUT`] per attempt; the
/// same as [`NatsSettings::new(urls).connect()`](NatsSettings::connect).
///
/// # Errors
/// [`NatsConnectError`], naming the servers without credentials: a URL that does not parse,
/// credentials the server refuses, or no server reachable.
pub async fn connect(urls: &str) -> Result<async_nats::Client, NatsConnectError> {
    NatsSettings::new(urls).connect().await
}

/// How to reach and authenticate to NATS. At most one way to authenticate: credentials in
/// the URL (user and password, or a token), `user` and `password`, `token`, `nkey_seed`, or
/// `credentials_file`. Its `Debug` shows no secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct NatsSettings {
    /// One server URL, or several separated by commas (a cluster).
    pub urls: String,
    /// A user, with [`password`](Self::password).
    pub user: Option<String>,
    /// The user's password.
    pub password: Option<String>,
    /// A token.
    pub token: Option<String>,
    /// An NKey seed (`SU...`): the client signs the server's nonce with it.
    pub nkey_seed: Option<String>,
    /// A `.creds` file (a user JWT and its NKey seed), as `nsc` writes it.
    pub credentials_file: Option<PathBuf>,
    /// A PEM file of the CA certificates that sign the server's (for a private CA).
    pub ca_file: Option<PathBuf>,
    /// A PEM client certificate, with [`client_key`](Self::client_key), for mutual TLS.
    pub client_cert: Option<PathBuf>,
    /// The client certificate's PEM private key.
    pub client_key: Option<PathBuf>,
    /// Refuse a connection without TLS (also implied by a `tls://` URL, a CA or a client
    /// certificate).
    pub require_tls: bool,
    /// The connection's name, shown by the server (`connz`).
    pub name: Option<String>,
}

impl fmt::Debug for NatsSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secret = |value: &Option<String>| value.as_ref().map(|_| "<redacted>");
        f.debug_struct("NatsSettings")
            .field("urls", &redacted(&self.urls))
            .field("user", &self.user)
            .field("password", &secret(&self.password))
            .field("token", &secret(&self.token))
            .field("nkey_seed", &secret(&self.nkey_seed))
            .field("credentials_file", &self.credentials_file)
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .field("require_tls", &self.require_tls)
            .field("name", &self.name)
            .finish()
    }
}

impl NatsSettings {
    /// Settings for `urls`, with whatever credentials they carry.
    pub fn new(urls: impl Into<String>) -> Self {
        Self {
            urls: urls.into(),
            ..Self::default()
        }
    }

    /// The options and servers these settings connect with.
    ///
    /// # Errors
    /// [`NatsConnectError`] when a URL does not parse, when two ways to authenticate are
    /// given, or when a password comes without a user (or a client key without its
    /// certificate), or the NKey seed does not parse, or the credentials file cannot be
    /// read, or a TLS file (`ca_file`, `client_cert`, `client_key`) cannot be read or holds
    /// no PEM certificate (key): each named by its path.
    pub async fn options(&self) -> Result<(ConnectOptions, Vec<ServerAddr>), NatsConnectError> {
        let error = |reason: String| NatsConnectError {
            servers: redacted(&self.urls),
            reason,
        };
        let (servers, in_url) = parse(&self.urls).map_err(error)?;
        let mut ways = Vec::new();
        if in_url != Credentials::None {
            ways.push("credentials in the URL");
        }
        if self.user.is_some() || self.password.is_some() {
            ways.push("a user and password");
        }
        for (set, way) in [
            (self.token.is_some(), "a token"),
            (self.nkey_seed.is_some(), "an NKey seed"),
            (self.credentials_file.is_some(), "a credentials file"),
        ] {
            if set {
                ways.push(way);
            }
        }
        if ways.len() > 1 {
            return Err(error(format!(
                "give one way to authenticate, not {}",
                ways.join(" and ")
            )));
        }
        let mut options = match (&self.user, &self.password) {
            (Some(user), password) => ConnectOptions::with_user_and_password(
                user.clone(),
                password.clone().unwrap_or_default(),
            ),
            (None, Some(_)) => return Err(error("a password without a user".to_owned())),
            (None, None) => match in_url {
                Credentials::None => ConnectOptions::new(),
                Credentials::Token(token) => ConnectOptions::with_token(token),
                Credentials::UserPassword(user, password) => {
                    ConnectOptions::with_user_and_password(user, password)
                }
            },
        };
        if let Some(token) = &self.token {
            options = options.token(token.clone());
        }
        if let Some(seed) = &self.nkey_seed {
            // async-nats reads the seed only to sign the server's nonce, and says then that it
            // "failed signing nonce"; nkeys' error names what is wrong, never the seed.
            nkeys::KeyPair::from_seed(seed).map_err(|e| {
                error(format!(
                    "the NKey seed does not parse: {e} (a user's seed is 58 characters starting \
                     with SU, as `nsc` or `nk -gen user` writes it)"
                ))
            })?;
            options = options.nkey(seed.clone());
        }
        if let Some(path) = &self.credentials_file {
            options = options
                .credentials_file(path)
                .await
                .map_err(|e| error(format!("credentials file {}: {e}", path.display())))?;
        }
        let mut tls = self.require_tls;
        if let Some(ca) = &self.ca_file {
            options = options.add_root_certificates(ca.clone());
            tls = true;
        }
        match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                options = options.add_client_certificate(cert.clone(), key.clone());
                tls = true;
            }
            (None, None) => {}
            _ => {
                return Err(error(
                    "a client certificate needs its key, and a key its certificate".to_owned(),
                ));
            }
        }
        // async-nats reads these files when it connects, and said "TLS error: No such file or
        // directory" without the file, and took one without a certificate for no CA at all.
        let files = [
            (
                "CA file",
                &self.ca_file,
                "certificate",
                read_certificates as PemRead,
            ),
            (
                "client certificate",
                &self.client_cert,
                "certificate",
                read_certificates,
            ),
            (
                "client key",
                &self.client_key,
                "private key",
                read_private_key,
            ),
        ];
        for (what, path, item, read) in files {
            if let Some(path) = path {
                check_pem(what, path, item, read).map_err(error)?;
            }
        }
        if tls {
            options = options.require_tls(true);
        }
        if let Some(name) = &self.name {
            options = options.name(name);
        }
        Ok((options, servers))
    }

    /// Connects, within [`CONNECT_TIMEOUT`] per attempt.
    ///
    /// # Errors
    /// [`NatsConnectError`], naming the servers without credentials: settings that do not
    /// hold together (see [`options`](Self::options)), credentials the server refuses, no
    /// server reachable, or one that did not complete the handshake within
    /// [`CONNECT_TIMEOUT`] (the error says so, and names the bound), or TLS asked of a server
    /// that answers in plain text (the error says so).
    pub async fn connect(&self) -> Result<async_nats::Client, NatsConnectError> {
        let (options, servers) = self.options().await?;
        options
            .connection_timeout(CONNECT_TIMEOUT)
            .connect(servers)
            .await
            .map_err(|e| NatsConnectError {
                servers: redacted(&self.urls),
                reason: if e.kind() == async_nats::ConnectErrorKind::TimedOut {
                    format!(
                        "{e}: no NATS handshake within {CONNECT_TIMEOUT:?}, the connection \
                         timeout of each attempt (the host drops the packets, or what listens \
                         there does not speak NATS)"
                    )
                } else if answered_in_plain_text(&e) {
                    format!(
                        "{e}: the server answered the TLS handshake in plain text: it runs \
                         without TLS (no tls block in its configuration), or this is not its TLS \
                         port; connect without TLS (no CA file, client certificate, \
                         require_tls or tls:// URL), or give the server TLS"
                    )
                } else {
                    e.to_string()
                },
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jetstream_request_without_responders_is_told_as_no_jetstream() {
        use async_nats::jetstream::context::{
            GetStreamError, GetStreamErrorKind, RequestError, RequestErrorKind,
        };
        let lookup = |kind| {
            GetStreamError::with_source(GetStreamErrorKind::Request, RequestError::new(kind))
        };
        let absent = lookup(RequestErrorKind::NoResponders);
        assert!(is_no_jetstream(&absent));
        assert_eq!(jetstream_error_text(&absent), NO_JETSTREAM);
        let timed_out = lookup(RequestErrorKind::TimedOut);
        assert!(!is_no_jetstream(&timed_out));
        assert_eq!(jetstream_error_text(&timed_out), timed_out.to_string());
        let missing = GetStreamError::new(GetStreamErrorKind::EmptyName);
        assert!(!is_no_jetstream(&missing));
    }

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
        assert!(error.reason.contains("other credentials"), "{error}");
        assert!(!error.to_string().contains("s3cret"), "{error}");
        let error = options("http://a:s3cret@n1").unwrap_err();
        assert!(!error.to_string().contains("s3cret"), "{error}");
        for url in ["nats://", "nats://a:s3cret@", "nats://n1,nats://:4222"] {
            // (async-nats refuses an empty host after credentials itself.)
            let error = options(url).unwrap_err();
            assert!(
                error
                    .reason
                    .ends_with("has no host: give it as nats://<host>:4222")
                    || error.reason.ends_with("empty host"),
                "{url}: {error}"
            );
            assert!(!error.to_string().contains("s3cret"), "{error}");
        }
        assert_eq!(redacted("nats://a:s3cret@n1:4222"), "nats://n1:4222");
    }

    /// A list of server URLs with one at fault is shown with the others as they are (no
    /// credentials), and the error names the one at fault by its place, where it said only
    /// "<a NATS URL that does not parse>" of URLs that all parse.
    #[test]
    fn an_error_in_a_list_of_urls_names_the_url_at_fault_and_shows_the_others() {
        let error = options("nats://a:s3cretA@n1:4222, nats://n2:4222,nats://a:s3cretB@n3:4222")
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "cannot connect to NATS at nats://n1:4222,nats://n2:4222,nats://n3:4222: server URL 3 \
             (nats://n3:4222) carries other credentials than URL 1 (nats://n1:4222): give one set"
        );
        let error = options("nats://t0ken@n1:4222,nats://").unwrap_err();
        assert_eq!(
            error.to_string(),
            "cannot connect to NATS at nats://n1:4222,nats://: server URL 2 (nats://) has no \
             host: give it as nats://<host>:4222"
        );
        let error = options("nats://n1:4222,http://a:s3cret@n2").unwrap_err();
        assert!(
            error.to_string().starts_with(
                "cannot connect to NATS at nats://n1:4222,<a NATS URL that does not \
                              parse>: server URL 2: "
            ),
            "{error}"
        );
        assert!(!error.to_string().contains("s3cret"), "{error}");
        assert_eq!(
            options(" , ").unwrap_err().to_string(),
            "cannot connect to NATS at <no NATS URL>: no server URL given"
        );
        // The same credentials in every URL that has some are one set.
        let (servers, credentials) =
            parse("nats://u:p@n1:4222,nats://n2:4222,nats://u:p@n3:4222").unwrap();
        assert_eq!(servers.len(), 3);
        assert!(credentials == Credentials::UserPassword("u".into(), "p".into()));
    }

    #[tokio::test]
    async fn one_way_to_authenticate_and_no_secret_in_debug() {
        let settings = NatsSettings {
            token: Some("t0k3n".into()),
            nkey_seed: Some("SUs33d".into()),
            ..NatsSettings::new("nats://u:pw@n1")
        };
        let error = settings.options().await.unwrap_err();
        assert_eq!(
            error.reason,
            "give one way to authenticate, not credentials in the URL and a token and an NKey seed"
        );
        let shown = format!("{settings:?}");
        for secret in ["t0k3n", "SUs33d", "pw"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        // A seed that is none is named as such before connecting, where async-nats said
        // "failed signing nonce" once the server asked; the seed is not shown.
        for seed in ["SUs33d", "SUAXXX", ""] {
            let bad = NatsSettings {
                nkey_seed: Some(seed.into()),
                ..NatsSettings::new("nats://n1")
            };
            let error = bad.options().await.unwrap_err();
            assert!(
                error.reason.starts_with("the NKey seed does not parse: "),
                "{seed:?}: {error}"
            );
            assert!(
                seed.is_empty() || !error.to_string().contains(seed),
                "{error}"
            );
        }
        let good = nkeys::KeyPair::new_user().seed().unwrap();
        let settings = NatsSettings {
            nkey_seed: Some(good),
            ..NatsSettings::new("nats://n1")
        };
        assert!(settings.options().await.is_ok());
        // TLS files are read before connecting, each named with its fault.
        let dir = std::env::temp_dir().join(format!("outbox-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let not_pem = dir.join("notes.txt");
        std::fs::write(&not_pem, "not a certificate\n").unwrap();
        let missing = dir.join("missing.pem");
        // A PEM section of the certificate kind (not a certificate's DER: the read is PEM's).
        let certificate = dir.join("cert.pem");
        std::fs::write(
            &certificate,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        for (settings, says) in [
            (
                NatsSettings {
                    ca_file: Some(missing.clone()),
                    ..NatsSettings::new("nats://n1")
                },
                format!("CA file {}: No such file or directory", missing.display()),
            ),
            (
                NatsSettings {
                    ca_file: Some(not_pem.clone()),
                    ..NatsSettings::new("nats://n1")
                },
                format!("CA file {}: it holds no PEM certificate", not_pem.display()),
            ),
            (
                NatsSettings {
                    client_cert: Some(not_pem.clone()),
                    client_key: Some(not_pem.clone()),
                    ..NatsSettings::new("nats://n1")
                },
                format!(
                    "client certificate {}: it holds no PEM certificate",
                    not_pem.display()
                ),
            ),
            (
                NatsSettings {
                    client_cert: Some(certificate.clone()),
                    client_key: Some(not_pem.clone()),
                    ..NatsSettings::new("nats://n1")
                },
                format!(
                    "client key {}: it holds no PEM private key",
                    not_pem.display()
                ),
            ),
        ] {
            let error = settings.options().await.unwrap_err();
            assert!(error.reason.starts_with(&says), "{says:?}: {error}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        let half = NatsSettings {
            client_key: Some("key.pem".into()),
            ..NatsSettings::new("nats://n1")
        };
        assert!(
            half.options()
                .await
                .unwrap_err()
                .reason
                .contains("needs its key")
        );
        let alone = NatsSettings {
            password: Some("pw".into()),
            ..NatsSettings::new("nats://n1")
        };
        assert_eq!(
            alone.options().await.unwrap_err().reason,
            "a password without a user"
        );
    }
}
