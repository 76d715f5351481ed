//! TLS for the PostgreSQL connections the toolkit opens itself (the relay's, the inbox's, the
//! migrations', the `outbox` command's), as a connection string's `sslmode` and `sslrootcert`
//! ask (PostgreSQL docs, "libpq: SSL Support", section "Protection Provided in Different
//! Modes"; the options are libpq's, in a URL's query or a `key=value` string):
//!
//! - `disable`, `prefer` (the default): no TLS, as diesel-async's own `establish` connects
//!   (tokio-postgres without a TLS connector). libpq's `prefer` would try TLS first, without
//!   verifying the server's certificate.
//! - `require`: TLS. The server's certificate is verified as for `verify-ca` when
//!   `sslrootcert` names the certificate authorities, and otherwise not: the connection is
//!   encrypted, and a man in the middle is not detected (libpq's `require` as well).
//! - `verify-ca`: TLS, and the server's certificate must chain to a certificate authority of
//!   `sslrootcert`: a PEM file, `system` for the operating system's store, or by default
//!   libpq's `~/.postgresql/root.crt`.
//! - `verify-full`: as `verify-ca`, and the certificate must name the host connected to.
//!
//! tokio-postgres knows `disable`, `prefer` and `require` only, and no `sslrootcert`: it is
//! given the string with `verify-ca` and `verify-full` as `require` and without
//! `sslrootcert`, and the TLS connector verifies what they ask. Client certificates
//! (`sslcert`, `sslkey`) are not supported: tokio-postgres refuses them as unknown options.

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;

use percent_encoding::percent_decode_str;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

/// The TLS a connection string asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Tls {
    /// No TLS (`disable`, `prefer`, or no `sslmode`).
    Off,
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

/// `database_url` as tokio-postgres parses it (`verify-ca` and `verify-full` written
/// `require`, `sslrootcert` removed), and the TLS it asks for.
///
/// # Errors
/// `verify-ca` or `verify-full` without `sslrootcert` where libpq's default file,
/// `~/.postgresql/root.crt`, does not exist.
pub(crate) fn split(database_url: &str) -> Result<(Cow<'_, str>, Tls), String> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    split_in(database_url, home.as_deref())
}

/// [`split`], with `home` the directory of libpq's default `.postgresql/root.crt`.
fn split_in<'a>(
    database_url: &'a str,
    home: Option<&std::path::Path>,
) -> Result<(Cow<'a, str>, Tls), String> {
    let options = Options::of(database_url);
    let Some(mode) = options.mode.as_deref() else {
        // No sslmode: tokio-postgres's default, prefer, which the toolkit connects without
        // TLS.
        return Ok((options.written(database_url, None), Tls::Off));
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
    let (tls, written) = match mode {
        "require" if root.is_some() => (Tls::VerifyCa(roots()?), None),
        "require" => (Tls::Unverified, None),
        "verify-ca" => (Tls::VerifyCa(roots()?), Some("require")),
        "verify-full" => (Tls::VerifyFull(roots()?), Some("require")),
        // disable, prefer; anything else is tokio-postgres's to refuse.
        _ => (Tls::Off, None),
    };
    Ok((options.written(database_url, written), tls))
}

/// `database_url` as tokio-postgres parses it, whatever certificate authorities its TLS
/// options name or lack ([`split`] without looking for them): for showing it.
pub(crate) fn parsable(database_url: &str) -> Cow<'_, str> {
    let options = Options::of(database_url);
    let verifying = matches!(options.mode.as_deref(), Some("verify-ca" | "verify-full"));
    options.written(database_url, verifying.then_some("require"))
}

impl Tls {
    /// The TLS connector for these settings; `None` for no TLS.
    ///
    /// # Errors
    /// `sslrootcert` cannot be read, holds no certificate, or the system's store is empty.
    pub(crate) fn connector(&self) -> Result<Option<MakeRustlsConnect>, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = || {
            ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("TLS: {e}"))
        };
        let config = match self {
            Self::Off => return Ok(None),
            Self::Unverified => builder()?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyName {
                    chain: None,
                    algorithms: provider.signature_verification_algorithms,
                }))
                .with_no_client_auth(),
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
                    .with_no_client_auth()
            }
            Self::VerifyFull(roots) => builder()?
                .with_root_certificates(roots.store()?)
                .with_no_client_auth(),
        };
        Ok(Some(MakeRustlsConnect::new(config)))
    }
}

impl Roots {
    fn store(&self) -> Result<RootCertStore, String> {
        let mut store = RootCertStore::empty();
        match self {
            Self::File(path) => {
                use rustls::pki_types::pem::PemObject as _;
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
    /// A `postgres://` URL: the byte offset of its query (after `?`), and the byte range of
    /// each pair in it. A `key=value` string: `None`.
    query: Option<(usize, Vec<std::ops::Range<usize>>)>,
    /// Where `sslmode`'s pair and value, and `sslrootcert`'s pair, are written.
    mode_at: Option<(std::ops::Range<usize>, std::ops::Range<usize>)>,
    root_at: Option<std::ops::Range<usize>>,
}

impl Options {
    /// The options of a `postgres://` URL's query, or of a `key=value` string (the last
    /// occurrence of each, as tokio-postgres takes it).
    fn of(database_url: &str) -> Self {
        let mut options = Self::default();
        let url = database_url.trim_start();
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let Some(start) = database_url.find('?').map(|at| at + 1) else {
                return options;
            };
            let mut pairs = Vec::new();
            let mut at = start;
            for pair in database_url[start..].split('&') {
                let range = at..at + pair.len();
                at = range.end + 1;
                pairs.push(range.clone());
                let Some((key, value)) = pair.split_once('=') else {
                    continue;
                };
                let decode = |text: &str| percent_decode_str(text).decode_utf8_lossy().into_owned();
                let value_at = range.start + key.len() + 1..range.end;
                options.take(&decode(key), decode(value), range, value_at);
            }
            options.query = Some((start, pairs));
        } else {
            for (key, value, pair, value_at) in KeyValues::new(database_url) {
                options.take(key, value, pair, value_at);
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
                self.root_at = Some(pair);
            }
            _ => {}
        }
    }

    /// `database_url` without its `sslrootcert` pair, and with its `sslmode` value `mode`
    /// when that is given: what tokio-postgres parses. A URL's query keeps its other pairs,
    /// joined by `&` (its parser takes an empty pair for a key), and loses its `?` when none
    /// is left.
    fn written<'a>(&self, database_url: &'a str, mode: Option<&str>) -> Cow<'a, str> {
        let mode = mode.zip(self.mode_at.clone());
        if mode.is_none() && self.root_at.is_none() {
            return Cow::Borrowed(database_url);
        }
        let Some((start, pairs)) = &self.query else {
            // A `key=value` string: the pair goes, and the spaces around it stay (skipped).
            let mut edits: Vec<(std::ops::Range<usize>, &str)> = Vec::new();
            if let Some((mode, (_, value_at))) = mode {
                edits.push((value_at, mode));
            }
            if let Some(pair) = self.root_at.clone() {
                edits.push((pair, ""));
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
            return Cow::Owned(text);
        };
        let mut kept = Vec::with_capacity(pairs.len());
        for pair in pairs {
            if Some(pair) == self.root_at.as_ref() {
                continue;
            }
            match &mode {
                Some((mode, (mode_pair, _))) if mode_pair == pair => {
                    kept.push(format!("sslmode={mode}"));
                }
                _ => kept.push(database_url[pair.clone()].to_owned()),
            }
        }
        let base = &database_url[..start - 1];
        Cow::Owned(if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        })
    }
}

/// The `key=value` pairs of a PostgreSQL connection string (PostgreSQL docs, "libpq:
/// Connection Strings", keyword/value form): spaces around `=` allowed, a value in single
/// quotes where it holds spaces, `\'` and `\\` escapes. Yields the key, the unescaped value,
/// and the byte ranges of the pair and of the value as written.
struct KeyValues<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> KeyValues<'a> {
    fn new(text: &'a str) -> Self {
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
        assert_eq!((parsed.as_ref(), tls), ("postgres://db/orders", Tls::Off));

        for url in [
            "postgres://db/orders",
            "postgres://db/orders?sslmode=prefer",
            "postgres://db/orders?sslmode=disable&connect_timeout=3",
        ] {
            assert_eq!(split(url).unwrap(), (Cow::Borrowed(url), Tls::Off), "{url}");
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
        let error = split_in(url, Some(&home)).unwrap_err();
        assert!(
            error.starts_with(
                "sslmode=verify-full verifies the server's certificate against certificate \
                 authorities, and none were given: name them with sslrootcert"
            ),
            "{error}"
        );
        assert_eq!(split_in(url, None).unwrap_err(), error);
        std::fs::create_dir_all(home.join(".postgresql")).unwrap();
        std::fs::write(home.join(".postgresql/root.crt"), "").unwrap();
        let found = split_in(url, Some(&home));
        std::fs::remove_dir_all(&home).unwrap();
        assert_eq!(
            found.unwrap().1,
            Tls::VerifyFull(Roots::File(home.join(".postgresql/root.crt")))
        );
    }

    #[test]
    fn an_unreadable_or_empty_root_certificate_file_is_named() {
        let missing = Tls::VerifyFull(Roots::File("/nonexistent/ca.pem".into()));
        let error = missing.connector().err().unwrap();
        assert!(
            error.starts_with("sslrootcert /nonexistent/ca.pem: "),
            "{error}"
        );
        let empty = std::env::temp_dir().join(format!("outbox-empty-{}.pem", uuid::Uuid::new_v4()));
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let error = Tls::VerifyCa(Roots::File(empty.clone()))
            .connector()
            .err()
            .unwrap();
        std::fs::remove_file(&empty).unwrap();
        assert!(
            error.ends_with("holds no certificate (a PEM -----BEGIN CERTIFICATE----- section)"),
            "{error}"
        );
    }
}
