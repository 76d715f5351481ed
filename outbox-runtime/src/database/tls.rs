//! TLS for the PostgreSQL connections the toolkit opens itself (the relay's, the inbox's, the
//! migrations', the `outbox` command's), as a connection string's `sslmode` and `sslrootcert`
//! ask (PostgreSQL docs, "libpq: SSL Support", section "Protection Provided in Different
//! Modes"; the options are libpq's, in a URL's query or a `key=value` string):
//!
//! - `disable`: no TLS, as diesel-async's own `establish` connects (tokio-postgres without a
//!   TLS connector).
//! - `prefer` (the default): no TLS, unless the server refuses a session without it (its
//!   `pg_hba.conf` has a `hostssl` line for the session and no `host` one: "no pg_hba.conf
//!   entry ..., no encryption"); then TLS without verifying the server's certificate, as
//!   libpq's `prefer` gives it. libpq tries TLS first; here a server that takes both is
//!   reached without TLS, as diesel-async's `establish` reaches it.
//! - `require`: TLS. The server's certificate is verified as for `verify-ca` when
//!   `sslrootcert` names the certificate authorities, and otherwise not: the connection is
//!   encrypted, and a man in the middle is not detected (libpq's `require` as well).
//! - `verify-ca`: TLS, and the server's certificate must chain to a certificate authority of
//!   `sslrootcert`: a PEM file, `system` for the operating system's store, or by default
//!   libpq's `~/.postgresql/root.crt`.
//! - `verify-full`: as `verify-ca`, and the certificate must name the host connected to.
//!
//! A client certificate is sent where the server asks for one (its `cert` authentication, or
//! `clientcert=verify-ca` / `verify-full`; PostgreSQL docs, "Client Certificates"): the PEM
//! file `sslcert` and its key `sslkey`, by default libpq's `~/.postgresql/postgresql.crt`
//! and `~/.postgresql/postgresql.key` when the certificate's file exists. The key is PKCS #8,
//! PKCS #1 (RSA) or SEC1 (EC), unencrypted (no `sslpassword`). A `sslcert` or `sslkey` given
//! where the toolkit connects without TLS (no `sslmode`, or `prefer`) is refused: no
//! certificate would be sent.
//!
//! Where the string does not give them, libpq's environment variables do: `PGSSLMODE`,
//! `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY` (PostgreSQL docs, "libpq: Environment
//! Variables"; a deployment that sets them beside a URL from a secret). `PGPASSWORD` and
//! `PGPASSFILE` give a password the string does not give (the module `password`, which also
//! takes libpq's `passfile` option, removed from the string here), and `PGHOST`, `PGPORT`,
//! `PGUSER`, `PGDATABASE`, `PGOPTIONS` what else it leaves out (the module `defaults`);
//! tokio-postgres reads none.
//!
//! Over a Unix socket no TLS is negotiated, whatever the mode: "sslmode is ignored for Unix
//! domain socket communication" (PostgreSQL docs, "libpq: Parameter Key Words"), and
//! `psql` connects there with `sslmode=verify-full` (a Cloud SQL proxy's socket, say).
//!
//! tokio-postgres knows `disable`, `prefer` and `require` only, and none of `sslrootcert`,
//! `sslcert`, `sslkey`: it is given the string with `verify-ca` and `verify-full` as
//! `require` and without those three, and the TLS connector does what they ask.

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;

use percent_encoding::percent_decode_str;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{WantsClientCert, WebPkiServerVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, ConfigBuilder, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

/// The TLS a connection string asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Tls {
    /// No TLS (`disable`; and over Unix sockets, whatever the mode).
    Off,
    /// No TLS unless the server refuses a session without it, then TLS as
    /// [`Unverified`](Self::Unverified) (`prefer`, or no `sslmode`).
    Prefer,
    /// TLS without verifying the server's certificate (`require` without `sslrootcert`).
    Unverified,
    /// TLS, the certificate chained to `roots` (`verify-ca`, or `require` with
    /// `sslrootcert`).
    VerifyCa(Roots),
    /// TLS, the certificate chained to `roots` and naming the host (`verify-full`).
    VerifyFull(Roots),
}

/// Where the certificate authorities come from (`sslrootcert`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Roots {
    /// A PEM file of certificates.
    File(PathBuf),
    /// The operating system's store (`sslrootcert=system`, as libpq 16 spells it).
    System,
}

/// A client certificate and its key, as files (`sslcert`, `sslkey`): read when a connection
/// is opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    /// A PEM file of the certificate, then any intermediates.
    pub certificate: PathBuf,
    /// A PEM file of its private key.
    pub key: PathBuf,
}

/// `database_url` as tokio-postgres parses it (`verify-ca` and `verify-full` written
/// `require`; `sslrootcert`, `sslcert` and `sslkey` removed), the TLS it asks for, and the
/// client certificate it names.
///
/// # Errors
/// `verify-ca` or `verify-full` without `sslrootcert` where libpq's default file,
/// `~/.postgresql/root.crt`, does not exist; `sslcert` or `sslkey` without TLS, `sslcert`
/// naming no file, or a certificate without its key.
pub(crate) fn split(database_url: &str) -> Result<(Cow<'_, str>, Tls, Option<Identity>), String> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let environment = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
    split_in(database_url, home.as_deref(), &environment)
}

/// [`split`], with `home` the directory of libpq's default `.postgresql` files and
/// `environment` the process's variables.
fn split_in<'a>(
    database_url: &'a str,
    home: Option<&std::path::Path>,
    environment: &dyn Fn(&str) -> Option<String>,
) -> Result<(Cow<'a, str>, Tls, Option<Identity>), String> {
    let mut options = Options::of(database_url);
    options.default_from(environment)?;
    let Some(mode) = options.mode.as_deref().filter(|mode| *mode != "prefer") else {
        // No sslmode, or prefer: the toolkit connects without TLS, unless the server takes
        // TLS sessions only.
        if let Some(key) = [("sslcert", &options.cert), ("sslkey", &options.key)]
            .into_iter()
            .find_map(|(key, value)| value.is_some().then_some(key))
        {
            return Err(format!(
                "{key} is given, and sslmode {} sends no client certificate here (it connects \
                 without TLS, or with TLS where the server takes TLS sessions only, without a \
                 certificate): set sslmode=verify-full (or verify-ca, require)",
                options.mode.as_deref().unwrap_or("prefer (the default)")
            ));
        }
        return Ok((options.written(database_url, None), Tls::Prefer, None));
    };
    let root = options.root.as_deref();
    let roots = || -> Result<Roots, String> {
        match root {
            Some("system") => Ok(Roots::System),
            Some(path) => Ok(Roots::File(PathBuf::from(path))),
            None => home
                .map(|home| home.join(".postgresql").join("root.crt"))
                .filter(|path| path.is_file())
                .map(Roots::File)
                .ok_or_else(|| {
                    format!(
                        "sslmode={mode} verifies the server's certificate against certificate \
                         authorities, and none were given: name them with sslrootcert (a PEM \
                         file, or `system` for the operating system's), or place them in \
                         ~/.postgresql/root.crt"
                    )
                }),
        }
    };
    let tls = match mode {
        "require" if root.is_some() => Tls::VerifyCa(roots()?),
        "require" => Tls::Unverified,
        "verify-ca" => Tls::VerifyCa(roots()?),
        "verify-full" => Tls::VerifyFull(roots()?),
        // disable (libpq ignores the client certificate there too); anything else is
        // tokio-postgres's to refuse.
        _ => return Ok((options.written(database_url, None), Tls::Off, None)),
    };
    let identity = options.identity(home, environment)?;
    // `require` for tokio-postgres, written where the mode came from the environment too:
    // without it, its default `prefer` would go on without TLS where the server has none.
    Ok((
        options.written(database_url, Some("require")),
        tls,
        identity,
    ))
}

/// The password file `database_url` names (libpq's `passfile` option), which [`split`]
/// removes from the string.
pub(crate) fn passfile(database_url: &str) -> Option<String> {
    Options::of(database_url).passfile
}

/// `database_url` as tokio-postgres parses it, whatever certificate authorities its TLS
/// options name or lack ([`split`] without looking for them): for showing it.
pub(crate) fn parsable(database_url: &str) -> Cow<'_, str> {
    let options = Options::of(database_url);
    let verifying = matches!(options.mode.as_deref(), Some("verify-ca" | "verify-full"));
    options.written(database_url, verifying.then_some("require"))
}

impl Identity {
    /// The certificate chain and the key.
    fn read(&self) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
        let shown = self.certificate.display();
        let chain = CertificateDer::pem_file_iter(&self.certificate)
            .and_then(Iterator::collect::<Result<Vec<_>, _>>)
            .map_err(|e| format!("sslcert {shown}: {e}"))?;
        if chain.is_empty() {
            return Err(format!(
                "sslcert {shown} holds no certificate (a PEM -----BEGIN CERTIFICATE----- section)"
            ));
        }
        let shown = self.key.display();
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| match e {
            rustls::pki_types::pem::Error::NoItemsFound => format!(
                "sslkey {shown} holds no private key (a PEM PRIVATE KEY, RSA PRIVATE KEY or EC \
                 PRIVATE KEY section; an encrypted key is not supported)"
            ),
            e => format!("sslkey {shown}: {e}"),
        })?;
        Ok((chain, key))
    }
}

/// The cryptography of the PostgreSQL connections' TLS: the process's default
/// [`CryptoProvider`], where the service installed one
/// ([`CryptoProvider::install_default`], say aws-lc-rs's, for its post-quantum key exchange,
/// or a FIPS one), else *ring*'s, the one the toolkit builds (its rustls, async-nats's and
/// mysql_async's all on *ring*).
fn provider() -> Arc<CryptoProvider> {
    if let Some(installed) = CryptoProvider::get_default() {
        return Arc::clone(installed);
    }
    // rustls 0.23.48 deprecates *ring*'s provider, which has no post-quantum key exchange;
    // the one that has it, aws-lc-rs's, needs cmake and a C compiler to build, so *ring*
    // stays the toolkit's and a service that wants the hybrid exchange installs aws-lc-rs's.
    #[allow(deprecated)]
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Tls {
    /// The TLS connector for these settings, sending `identity` to a server that asks for a
    /// client certificate; `None` for no TLS.
    ///
    /// # Errors
    /// `sslrootcert` cannot be read, holds no certificate, or the system's store is empty;
    /// `sslcert` or `sslkey` cannot be read or hold no certificate or key, or the key is not
    /// the certificate's.
    pub(crate) fn connector(
        &self,
        identity: Option<&Identity>,
    ) -> Result<Option<MakeRustlsConnect>, String> {
        let provider = provider();
        let builder = || {
            ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("TLS: {e}"))
        };
        let verified: ConfigBuilder<ClientConfig, WantsClientCert> = match self {
            Self::Off | Self::Prefer => return Ok(None),
            Self::Unverified => builder()?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyName {
                    chain: None,
                    algorithms: provider.signature_verification_algorithms,
                })),
            Self::VerifyCa(roots) => {
                let chain = WebPkiServerVerifier::builder_with_provider(
                    Arc::new(roots.store()?),
                    provider.clone(),
                )
                .build()
                .map_err(|e| format!("TLS: {e}"))?;
                builder()?
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyName {
                        chain: Some(chain),
                        algorithms: provider.signature_verification_algorithms,
                    }))
            }
            Self::VerifyFull(roots) => builder()?.with_root_certificates(roots.store()?),
        };
        let config = match identity {
            None => verified.with_no_client_auth(),
            Some(identity) => {
                let (chain, key) = identity.read()?;
                verified.with_client_auth_cert(chain, key).map_err(|e| {
                    format!(
                        "sslcert {} with sslkey {}: {e}",
                        identity.certificate.display(),
                        identity.key.display()
                    )
                })?
            }
        };
        Ok(Some(MakeRustlsConnect::new(config)))
    }
}

impl Roots {
    fn store(&self) -> Result<RootCertStore, String> {
        let mut store = RootCertStore::empty();
        match self {
            Self::File(path) => {
                let shown = path.display();
                let certificates = CertificateDer::pem_file_iter(path)
                    .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                    .map_err(|e| format!("sslrootcert {shown}: {e}"))?;
                let (added, _) = store.add_parsable_certificates(certificates);
                if added == 0 {
                    return Err(format!(
                        "sslrootcert {shown} holds no certificate (a PEM -----BEGIN CERTIFICATE----- \
                         section)"
                    ));
                }
            }
            Self::System => {
                let found = rustls_native_certs::load_native_certs();
                store.add_parsable_certificates(found.certs);
                if store.is_empty() {
                    return Err(format!(
                        "sslrootcert=system: the operating system's store holds no certificate \
                         authority ({:?})",
                        found.errors
                    ));
                }
            }
        }
        Ok(store)
    }
}

/// The verification of libpq's `require` without root certificates (`chain` `None`: any
/// certificate) and of its `verify-ca` (`chain`: webpki's verification without the check of
/// the name). Either way the handshake's signatures are checked, so the server holds the key
/// of the certificate it showed.
#[derive(Debug)]
struct AnyName {
    chain: Option<Arc<WebPkiServerVerifier>>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        use rustls::{CertificateError, Error};
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The TLS options of a connection string, and where each is written.
#[derive(Debug, Default)]
struct Options {
    mode: Option<String>,
    root: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    /// libpq's `passfile`, the password file (not TLS, but an option tokio-postgres lacks
    /// too: removed from the string like the three below).
    passfile: Option<String>,
    /// A `postgres://` URL: the byte offset of its query (after `?`), and the byte range of
    /// each pair in it. A `key=value` string: `None`.
    query: Option<(usize, Vec<std::ops::Range<usize>>)>,
    /// Where `sslmode`'s pair and value are written.
    mode_at: Option<(std::ops::Range<usize>, std::ops::Range<usize>)>,
    /// Where each pair of `sslrootcert`, `sslcert`, `sslkey` and `passfile` is written (every
    /// one of them, if one is given twice): what tokio-postgres must not see.
    removed: Vec<std::ops::Range<usize>>,
    /// Whether the string is a `postgres://` URL (else a `key=value` string).
    url: bool,
}

impl Options {
    /// The options of a `postgres://` URL's query, or of a `key=value` string (the last
    /// occurrence of each, as tokio-postgres takes it).
    fn of(database_url: &str) -> Self {
        let mut options = Self::default();
        let (form, pairs) = pairs(database_url);
        if let Form::Url { query } = form {
            options.url = true;
            options.query =
                query.map(|start| (start, pairs.iter().map(|p| p.at.clone()).collect()));
        }
        for pair in pairs {
            if let Some(value_at) = pair.value_at {
                options.take(&pair.key, pair.value, pair.at, value_at);
            }
        }
        options
    }

    fn take(
        &mut self,
        key: &str,
        value: String,
        pair: std::ops::Range<usize>,
        value_at: std::ops::Range<usize>,
    ) {
        match key {
            "sslmode" => {
                self.mode = Some(value);
                self.mode_at = Some((pair, value_at));
            }
            "sslrootcert" => {
                self.root = Some(value);
                self.removed.push(pair);
            }
            "sslcert" => {
                self.cert = Some(value);
                self.removed.push(pair);
            }
            "sslkey" => {
                self.key = Some(value);
                self.removed.push(pair);
            }
            "passfile" => {
                self.passfile = Some(value);
                self.removed.push(pair);
            }
            _ => {}
        }
    }

    /// Takes `sslmode` and `sslrootcert` from libpq's environment variables `PGSSLMODE` and
    /// `PGSSLROOTCERT` where the string does not give them (PostgreSQL docs, "libpq:
    /// Environment Variables").
    ///
    /// # Errors
    /// A `PGSSLMODE` that is not one of `disable`, `prefer`, `require`, `verify-ca`,
    /// `verify-full` (tokio-postgres would refuse it in the string).
    fn default_from(&mut self, environment: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
        if self.mode.is_none()
            && let Some(mode) = environment("PGSSLMODE")
        {
            const MODES: [&str; 5] = ["disable", "prefer", "require", "verify-ca", "verify-full"];
            if !MODES.contains(&mode.as_str()) {
                return Err(format!(
                    "PGSSLMODE {mode:?} is not a mode the toolkit takes: one of {}",
                    MODES.join(", ")
                ));
            }
            self.mode = Some(mode);
        }
        if self.root.is_none() {
            self.root = environment("PGSSLROOTCERT");
        }
        Ok(())
    }

    /// The client certificate, as libpq finds it (PostgreSQL docs, "libpq: SSL Support",
    /// "Client Certificates"): `sslcert` (or `PGSSLCERT`), or `~/.postgresql/postgresql.crt`
    /// where that file exists; its key `sslkey` (or `PGSSLKEY`), or
    /// `~/.postgresql/postgresql.key`.
    fn identity(
        &self,
        home: Option<&std::path::Path>,
        environment: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Identity>, String> {
        let default = |name: &str| home.map(|home| home.join(".postgresql").join(name));
        let (cert, key) = (
            self.cert.clone().or_else(|| environment("PGSSLCERT")),
            self.key.clone().or_else(|| environment("PGSSLKEY")),
        );
        let certificate = match &cert {
            Some(path) => {
                let path = PathBuf::from(path);
                if !path.is_file() {
                    return Err(format!("sslcert {}: no such file", path.display()));
                }
                path
            }
            None => match default("postgresql.crt").filter(|path| path.is_file()) {
                Some(path) => path,
                None if key.is_some() => {
                    return Err(
                        "sslkey is given without a certificate: name it with sslcert".to_owned(),
                    );
                }
                None => return Ok(None),
            },
        };
        let key = match (&key, default("postgresql.key")) {
            (Some(path), _) => PathBuf::from(path),
            (None, Some(path)) if path.is_file() => path,
            (None, _) => {
                return Err(format!(
                    "sslcert {} is given without its key: name it with sslkey (libpq's \
                     default, ~/.postgresql/postgresql.key, does not exist)",
                    certificate.display()
                ));
            }
        };
        Ok(Some(Identity { certificate, key }))
    }

    /// `database_url` without its `sslrootcert`, `sslcert` and `sslkey` pairs, and with its
    /// `sslmode` value `mode` when that is given: what tokio-postgres parses. A URL's query
    /// keeps its other pairs, joined by `&` (its parser takes an empty pair for a key), and
    /// loses its `?` when none is left.
    fn written<'a>(&self, database_url: &'a str, mode: Option<&str>) -> Cow<'a, str> {
        // A mode the string does not give (it came from the environment) is added to it.
        let added = mode.filter(|_| self.mode_at.is_none());
        let mode = mode.zip(self.mode_at.clone());
        if mode.is_none() && added.is_none() && self.removed.is_empty() {
            return Cow::Borrowed(database_url);
        }
        if self.url && self.query.is_none() {
            // A URL without a query: only a mode can have been added.
            return match added {
                Some(mode) => Cow::Owned(format!("{database_url}?sslmode={mode}")),
                None => Cow::Borrowed(database_url),
            };
        }
        let Some((start, pairs)) = &self.query else {
            // A `key=value` string: the pair goes, and the spaces around it stay (skipped).
            let mut edits: Vec<(std::ops::Range<usize>, &str)> = Vec::new();
            if let Some((mode, (_, value_at))) = mode {
                edits.push((value_at, mode));
            }
            for pair in &self.removed {
                edits.push((pair.clone(), ""));
            }
            edits.sort_by_key(|(range, _)| range.start);
            let mut text = String::with_capacity(database_url.len());
            let mut at = 0;
            for (range, replacement) in edits {
                text.push_str(&database_url[at..range.start]);
                text.push_str(replacement);
                at = range.end;
            }
            text.push_str(&database_url[at..]);
            if let Some(mode) = added {
                text.push_str(" sslmode=");
                text.push_str(mode);
            }
            return Cow::Owned(text);
        };
        let mut kept = Vec::with_capacity(pairs.len());
        for pair in pairs {
            if self.removed.contains(pair) {
                continue;
            }
            match &mode {
                Some((mode, (mode_pair, _))) if mode_pair == pair => {
                    kept.push(format!("sslmode={mode}"));
                }
                _ => kept.push(database_url[pair.clone()].to_owned()),
            }
        }
        if let Some(mode) = added {
            kept.push(format!("sslmode={mode}"));
        }
        let base = &database_url[..start - 1];
        Cow::Owned(if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        })
    }
}

/// What a connection string is: a `postgres://` URL, with the byte offset of its query
/// (after `?`) if it has one, or a `key=value` string.
pub(super) enum Form {
    Url { query: Option<usize> },
    KeyValues,
}

/// One pair of a connection string as written: its key and value (a URL's percent-decoded,
/// a `key=value` string's unquoted), the byte range of the pair, and of its value (`None`
/// for a URL's query pair without `=`).
pub(super) struct Pair {
    pub(super) key: String,
    pub(super) value: String,
    pub(super) at: std::ops::Range<usize>,
    pub(super) value_at: Option<std::ops::Range<usize>>,
}

/// The pairs of `database_url`: a `postgres://` URL's query pairs (`&`-separated), or a
/// `key=value` string's ([`KeyValues`]), in their order.
pub(super) fn pairs(database_url: &str) -> (Form, Vec<Pair>) {
    let trimmed = database_url.trim_start();
    if !(trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://")) {
        let pairs = KeyValues::new(database_url)
            .map(|(key, value, at, value_at)| Pair {
                key: key.to_owned(),
                value,
                at,
                value_at: Some(value_at),
            })
            .collect();
        return (Form::KeyValues, pairs);
    }
    let Some(start) = database_url.find('?').map(|at| at + 1) else {
        return (Form::Url { query: None }, Vec::new());
    };
    let decode = |text: &str| percent_decode_str(text).decode_utf8_lossy().into_owned();
    let mut pairs = Vec::new();
    let mut at = start;
    for pair in database_url[start..].split('&') {
        let range = at..at + pair.len();
        at = range.end + 1;
        pairs.push(match pair.split_once('=') {
            Some((key, value)) => Pair {
                key: decode(key),
                value: decode(value),
                value_at: Some(range.start + key.len() + 1..range.end),
                at: range,
            },
            None => Pair {
                key: decode(pair),
                value: String::new(),
                value_at: None,
                at: range,
            },
        });
    }
    (Form::Url { query: Some(start) }, pairs)
}

/// The `key=value` pairs of a PostgreSQL connection string (PostgreSQL docs, "libpq:
/// Connection Strings", keyword/value form): spaces around `=` allowed, a value in single
/// quotes where it holds spaces, `\'` and `\\` escapes. Yields the key, the unescaped value,
/// and the byte ranges of the pair and of the value as written.
pub(super) struct KeyValues<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> KeyValues<'a> {
    pub(super) fn new(text: &'a str) -> Self {
        Self { text, at: 0 }
    }

    fn skip_spaces(&mut self) {
        let rest = &self.text[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }
}

impl<'a> Iterator for KeyValues<'a> {
    type Item = (
        &'a str,
        String,
        std::ops::Range<usize>,
        std::ops::Range<usize>,
    );

    fn next(&mut self) -> Option<Self::Item> {
        self.skip_spaces();
        let start = self.at;
        let rest = &self.text[start..];
        let key_len = rest.find(|c: char| c == '=' || c.is_whitespace())?;
        let key = &rest[..key_len];
        self.at += key_len;
        self.skip_spaces();
        if !self.text[self.at..].starts_with('=') {
            // Not a connection string tokio-postgres would parse either.
            self.at = self.text.len();
            return None;
        }
        self.at += 1;
        self.skip_spaces();
        let value_start = self.at;
        let mut value = String::new();
        let mut chars = self.text[value_start..].char_indices();
        let quoted = self.text[value_start..].starts_with('\'');
        if quoted {
            chars.next();
        }
        let mut end = self.text.len();
        while let Some((offset, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, escaped)) = chars.next() {
                        value.push(escaped);
                    }
                }
                '\'' if quoted => {
                    end = value_start + offset + 1;
                    break;
                }
                c if !quoted && c.is_whitespace() => {
                    end = value_start + offset;
                    break;
                }
                c => value.push(c),
            }
        }
        self.at = end;
        Some((key, value, start..end, value_start..end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`split`] without a client certificate: the string and the TLS.
    fn split(database_url: &str) -> Result<(Cow<'_, str>, Tls), String> {
        let (url, tls, identity) = super::split_in(database_url, None, &|_| None)?;
        assert_eq!(identity, None, "{database_url}");
        Ok((url, tls))
    }

    /// The TLS of the toolkit's PostgreSQL sessions is *ring*'s until the service installs a
    /// process default, and then that one (here, *ring* with ChaCha20-Poly1305 alone). The
    /// only test of this binary that installs one.
    #[test]
    fn the_provider_is_the_one_the_service_installed_else_rings() {
        if CryptoProvider::get_default().is_none() {
            #[allow(deprecated)]
            let ring = rustls::crypto::ring::default_provider();
            assert_eq!(suites(&provider()), suites(&ring), "none installed: ring's");
        }
        #[allow(deprecated)]
        let chacha = CryptoProvider {
            cipher_suites: vec![rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256],
            ..rustls::crypto::ring::default_provider()
        };
        let installed = suites(&chacha);
        let _ = chacha.install_default();
        assert_eq!(suites(&provider()), installed);
        assert_eq!(installed, ["TLS13_CHACHA20_POLY1305_SHA256"]);
    }

    fn suites(provider: &CryptoProvider) -> Vec<String> {
        provider
            .cipher_suites
            .iter()
            .map(|suite| format!("{:?}", suite.suite()))
            .collect()
    }

    #[test]
    fn require_and_the_verifying_modes_are_read_from_a_url() {
        let url = "postgres://app:s3cret@db:5432/orders?sslmode=verify-full&sslrootcert=/etc/ca.pem\
                   &application_name=x";
        let (parsed, tls) = split(url).unwrap();
        assert_eq!(tls, Tls::VerifyFull(Roots::File("/etc/ca.pem".into())));
        assert_eq!(
            parsed,
            "postgres://app:s3cret@db:5432/orders?sslmode=require&application_name=x"
        );
        let config = parsed.parse::<tokio_postgres::Config>().unwrap();
        assert_eq!(config.get_application_name(), Some("x"));

        let (parsed, tls) =
            split("postgresql://db/orders?sslrootcert=system&sslmode=verify-ca").unwrap();
        assert_eq!(tls, Tls::VerifyCa(Roots::System));
        assert_eq!(parsed, "postgresql://db/orders?sslmode=require");

        let (parsed, tls) =
            split("postgres://db/orders?sslmode=require&sslrootcert=%2Fca%20dir%2Fca.pem").unwrap();
        assert_eq!(tls, Tls::VerifyCa(Roots::File("/ca dir/ca.pem".into())));
        assert_eq!(parsed, "postgres://db/orders?sslmode=require");
        let (parsed, tls) = split("postgres://db/orders?sslrootcert=system").unwrap();
        assert_eq!(
            (parsed.as_ref(), tls),
            ("postgres://db/orders", Tls::Prefer)
        );

        for (url, tls) in [
            ("postgres://db/orders", Tls::Prefer),
            ("postgres://db/orders?sslmode=prefer", Tls::Prefer),
            (
                "postgres://db/orders?sslmode=disable&connect_timeout=3",
                Tls::Off,
            ),
        ] {
            assert_eq!(split(url).unwrap(), (Cow::Borrowed(url), tls), "{url}");
        }
        let url = "postgres://db/orders?sslmode=require";
        assert_eq!(split(url).unwrap(), (Cow::Borrowed(url), Tls::Unverified));
    }

    #[test]
    fn require_and_the_verifying_modes_are_read_from_a_key_value_string() {
        let (parsed, tls) = split(
            "host=db password='s3 cr\\'et' sslmode = verify-full sslrootcert='/ca dir/ca.pem' \
             dbname=orders",
        )
        .unwrap();
        assert_eq!(tls, Tls::VerifyFull(Roots::File("/ca dir/ca.pem".into())));
        assert_eq!(
            parsed,
            "host=db password='s3 cr\\'et' sslmode = require  dbname=orders"
        );
        let config = parsed.parse::<tokio_postgres::Config>().unwrap();
        assert_eq!(config.get_password(), Some(&b"s3 cr'et"[..]));
        assert_eq!(config.get_dbname(), Some("orders"));

        let url = "host=db sslmode=require";
        assert_eq!(split(url).unwrap(), (Cow::Borrowed(url), Tls::Unverified));
        // A password that spells an option is a value, not an option.
        let (_, tls) = split("host=db password='sslmode=verify-full' sslmode=disable").unwrap();
        assert_eq!(tls, Tls::Off);
    }

    #[test]
    fn a_verifying_mode_without_certificate_authorities_takes_libpqs_default_file_or_says_where_to_give_them()
     {
        let url = "postgres://db/orders?sslmode=verify-full";
        let home = std::env::temp_dir().join(format!("outbox-home-{}", uuid::Uuid::new_v4()));
        let error = split_in(url, Some(&home), &|_| None)
            .map(|(url, tls, _)| (url, tls))
            .unwrap_err();
        assert!(
            error.starts_with(
                "sslmode=verify-full verifies the server's certificate against certificate \
                 authorities, and none were given: name them with sslrootcert"
            ),
            "{error}"
        );
        assert_eq!(
            split_in(url, None, &|_| None).map(|_| ()).unwrap_err(),
            error
        );
        std::fs::create_dir_all(home.join(".postgresql")).unwrap();
        std::fs::write(home.join(".postgresql/root.crt"), "").unwrap();
        let found = split_in(url, Some(&home), &|_| None).map(|(url, tls, _)| (url, tls));
        std::fs::remove_dir_all(&home).unwrap();
        assert_eq!(
            found.unwrap().1,
            Tls::VerifyFull(Roots::File(home.join(".postgresql/root.crt")))
        );
    }

    #[test]
    fn an_unreadable_or_empty_root_certificate_file_is_named() {
        let missing = Tls::VerifyFull(Roots::File("/nonexistent/ca.pem".into()));
        let error = missing.connector(None).err().unwrap();
        assert!(
            error.starts_with("sslrootcert /nonexistent/ca.pem: "),
            "{error}"
        );
        let empty = std::env::temp_dir().join(format!("outbox-empty-{}.pem", uuid::Uuid::new_v4()));
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let error = Tls::VerifyCa(Roots::File(empty.clone()))
            .connector(None)
            .err()
            .unwrap();
        std::fs::remove_file(&empty).unwrap();
        assert!(
            error.ends_with("holds no certificate (a PEM -----BEGIN CERTIFICATE----- section)"),
            "{error}"
        );
    }

    /// A directory of its own under the temporary one, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new() -> Self {
            let dir = std::env::temp_dir().join(format!("outbox-tls-{}", uuid::Uuid::new_v4()));
            std::fs::create_dir_all(dir.join(".postgresql")).unwrap();
            Self(dir)
        }

        /// Writes `text` to `name` in it; returns the path.
        fn file(&self, name: &str, text: &str) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, text).unwrap();
            path
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn libpqs_passfile_is_taken_from_either_form_and_kept_from_tokio_postgres() {
        for (string, written) in [
            (
                "postgres://app@db/orders?passfile=%2Fetc%2Forders.pgpass&application_name=x",
                "postgres://app@db/orders?application_name=x",
            ),
            (
                "host=db passfile='/etc/orders.pgpass' dbname=orders",
                "host=db  dbname=orders",
            ),
        ] {
            assert_eq!(passfile(string).as_deref(), Some("/etc/orders.pgpass"));
            let (parsed, tls, _) = split_in(string, None, &|_| None).unwrap();
            assert_eq!((parsed.as_ref(), tls), (written, Tls::Prefer), "{string}");
            assert!(parsed.parse::<tokio_postgres::Config>().is_ok(), "{parsed}");
        }
        assert_eq!(passfile("postgres://app@db/orders"), None);
    }

    #[test]
    fn a_client_certificate_and_its_key_are_read_from_either_form_and_kept_from_tokio_postgres() {
        let scratch = Scratch::new();
        let (cert, key) = (scratch.file("c.pem", ""), scratch.file("c.key", ""));
        let identity = Identity {
            certificate: cert.clone(),
            key: key.clone(),
        };
        let url = format!(
            "postgres://app@db/orders?sslcert={}&sslmode=verify-full&sslrootcert=system\
             &sslkey={}&application_name=x&sslrootcert=system",
            cert.display(),
            key.display()
        );
        let (parsed, tls, found) = split_in(&url, None, &|_| None).unwrap();
        assert_eq!(
            (parsed.as_ref(), tls, found.as_ref()),
            (
                "postgres://app@db/orders?sslmode=require&application_name=x",
                Tls::VerifyFull(Roots::System),
                Some(&identity)
            )
        );
        let text = format!(
            "host=db sslmode=require sslcert='{}' sslkey={} dbname=orders",
            cert.display(),
            key.display()
        );
        let (parsed, tls, found) = split_in(&text, None, &|_| None).unwrap();
        assert_eq!(
            parsed
                .parse::<tokio_postgres::Config>()
                .unwrap()
                .get_dbname(),
            Some("orders")
        );
        assert_eq!((tls, found), (Tls::Unverified, Some(identity)));
        // libpq ignores them where TLS is off by choice.
        let (_, tls, found) = split_in(
            &format!("postgres://db/o?sslmode=disable&sslcert={}", cert.display()),
            None,
            &|_| None,
        )
        .unwrap();
        assert_eq!((tls, found), (Tls::Off, None));
    }

    #[test]
    fn a_client_certificate_without_tls_without_its_file_or_without_its_key_is_refused_naming_it() {
        let scratch = Scratch::new();
        let cert = scratch.file("c.pem", "");
        for (url, expected) in [
            (
                format!("postgres://db/o?sslcert={}", cert.display()),
                "sslcert is given, and sslmode prefer (the default) sends no client certificate \
                 here (it connects without TLS, or with TLS where the server takes TLS sessions \
                 only, without a certificate): set sslmode=verify-full",
            ),
            (
                "host=db sslmode=prefer sslkey=/k.pem".to_owned(),
                "sslkey is given, and sslmode prefer sends no client certificate here",
            ),
            (
                "postgres://db/o?sslmode=require&sslcert=/nonexistent/c.pem".to_owned(),
                "sslcert /nonexistent/c.pem: no such file",
            ),
            (
                "postgres://db/o?sslmode=require&sslkey=/k.pem".to_owned(),
                "sslkey is given without a certificate: name it with sslcert",
            ),
            (
                format!("postgres://db/o?sslmode=require&sslcert={}", cert.display()),
                "is given without its key: name it with sslkey",
            ),
        ] {
            let error = split_in(&url, Some(&scratch.0), &|_| None)
                .map(|_| ())
                .unwrap_err();
            assert!(error.contains(expected), "{url}: {error}");
        }
    }

    #[test]
    fn libpqs_default_client_certificate_is_sent_where_its_file_exists() {
        let scratch = Scratch::new();
        let url = "postgres://db/orders?sslmode=require";
        assert_eq!(split_in(url, Some(&scratch.0), &|_| None).unwrap().2, None);
        let cert = scratch.file(".postgresql/postgresql.crt", "");
        let error = split_in(url, Some(&scratch.0), &|_| None)
            .map(|_| ())
            .unwrap_err();
        assert!(
            error.ends_with("(libpq's default, ~/.postgresql/postgresql.key, does not exist)"),
            "{error}"
        );
        let key = scratch.file(".postgresql/postgresql.key", "");
        assert_eq!(
            split_in(url, Some(&scratch.0), &|_| None).unwrap().2,
            Some(Identity {
                certificate: cert,
                key
            })
        );
    }

    #[test]
    fn an_unreadable_client_certificate_or_key_is_named() {
        let scratch = Scratch::new();
        let junk = scratch.file("junk.pem", "not a certificate\n");
        let identity = |certificate: &PathBuf, key: &PathBuf| Identity {
            certificate: certificate.clone(),
            key: key.clone(),
        };
        let error = Tls::Unverified
            .connector(Some(&identity(&junk, &junk)))
            .err()
            .unwrap();
        assert!(
            error.ends_with("holds no certificate (a PEM -----BEGIN CERTIFICATE----- section)"),
            "{error}"
        );
        // Any PEM certificate section reads here (the handshake checks what it holds).
        let cert = scratch.file(
            "c.pem",
            "-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----\n",
        );
        let encrypted = scratch.file(
            "c.key",
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMAA=\n-----END ENCRYPTED PRIVATE KEY-----\n",
        );
        let error = Tls::Unverified
            .connector(Some(&identity(&cert, &encrypted)))
            .err()
            .unwrap();
        assert!(
            error.starts_with(&format!(
                "sslkey {} holds no private key (a PEM PRIVATE KEY, RSA PRIVATE KEY or EC \
                 PRIVATE KEY section; an encrypted key is not supported)",
                encrypted.display()
            )),
            "{error}"
        );
    }

    #[test]
    fn libpqs_environment_gives_what_the_string_does_not() {
        let scratch = Scratch::new();
        let (cert, key) = (scratch.file("c.pem", ""), scratch.file("c.key", ""));
        let (cert_text, key_text) = (cert.display().to_string(), key.display().to_string());
        let environment = |name: &str| match name {
            "PGSSLMODE" => Some("verify-full".to_owned()),
            "PGSSLROOTCERT" => Some("system".to_owned()),
            "PGSSLCERT" => Some(cert_text.clone()),
            "PGSSLKEY" => Some(key_text.clone()),
            _ => None,
        };
        let identity = Identity {
            certificate: cert.clone(),
            key: key.clone(),
        };
        // tokio-postgres is told `require`: its default, prefer, would go on without TLS.
        for (url, written) in [
            (
                "postgres://db/orders",
                "postgres://db/orders?sslmode=require",
            ),
            (
                "postgres://db/orders?application_name=x",
                "postgres://db/orders?application_name=x&sslmode=require",
            ),
            (
                "host=db dbname=orders",
                "host=db dbname=orders sslmode=require",
            ),
        ] {
            let (parsed, tls, found) = split_in(url, None, &environment).unwrap();
            assert_eq!(
                (parsed.as_ref(), &tls, found.as_ref()),
                (written, &Tls::VerifyFull(Roots::System), Some(&identity)),
                "{url}"
            );
            let config = parsed.parse::<tokio_postgres::Config>().unwrap();
            assert_eq!(
                config.get_ssl_mode(),
                tokio_postgres::config::SslMode::Require
            );
        }
        // The string's own options win, and a client certificate of the environment is not
        // refused where the string turns TLS off.
        let (parsed, tls, found) =
            split_in("postgres://db/orders?sslmode=disable", None, &environment).unwrap();
        assert_eq!(
            (parsed.as_ref(), tls, found),
            ("postgres://db/orders?sslmode=disable", Tls::Off, None)
        );
        let ca = scratch.file("ca.pem", "");
        let (_, tls, _) = split_in(
            &format!("postgres://db/orders?sslrootcert={}", ca.display()),
            None,
            &environment,
        )
        .unwrap();
        assert_eq!(tls, Tls::VerifyFull(Roots::File(ca)));

        let typo = |name: &str| (name == "PGSSLMODE").then(|| "verfy-full".to_owned());
        let error = split_in("postgres://db/orders", None, &typo)
            .map(|_| ())
            .unwrap_err();
        assert_eq!(
            error,
            "PGSSLMODE \"verfy-full\" is not a mode the toolkit takes: one of disable, prefer, \
             require, verify-ca, verify-full"
        );
    }
}
