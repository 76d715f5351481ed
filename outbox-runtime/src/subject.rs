//! NATS subjects: the token rule every name in a subject obeys, and the default subject
//! scheme `{prefix}.{aggregate_type}.{partition_key}.{event_type}`.
//!
//! A NATS subject is a list of tokens joined by `.`; `*` and `>` are wildcards, and the
//! protocol splits on whitespace (NATS docs, "Subject-Based Messaging", characters allowed
//! and recommended for subject names). async-nats does not check tokens beyond emptiness and
//! whitespace, and the server stores a publish to `a.*` as is, so a dynamic value that slips
//! into a subject unchecked would publish to the wrong place or to a wildcard. Every token is
//! therefore checked before its row is written: at compile time by the macros for the names
//! they generate, here for everything dynamic.
//!
//! The macros apply the same rule at compile time to the names they generate (a proc-macro
//! crate cannot call this one); the tests of both pin the same cases.
//!
//! Lengths are bounded too. nats-server reads a message's subject in its protocol control
//! line, which it holds to 4,096 bytes and closes the client's connection over
//! (`MAX_CONTROL_LINE_SIZE`, nats-server `server/const.go`): an unbounded aggregate id would
//! cost the relay its connection at every retry. A token holds at most [`MAX_TOKEN_BYTES`]
//! and a subject at most [`MAX_SUBJECT_BYTES`], which leaves the control line room for the
//! reply inbox and the sizes it also carries.

use std::fmt;

/// The most bytes a subject token holds: an aggregate type, an aggregate id, a partition key
/// or an event type. Checked at compile time for generated names and at commit for dynamic
/// ones.
pub const MAX_TOKEN_BYTES: usize = 256;

/// The most bytes a published subject holds, a quarter of nats-server's 4,096-byte control
/// line (see the module documentation). The relay refuses a row whose subject is longer.
pub const MAX_SUBJECT_BYTES: usize = 1024;

/// Why a string is not a valid NATS subject token.
///
/// A token is non-empty, at most [`MAX_TOKEN_BYTES`] long, and contains none of `.` (the
/// separator), `*` and `>` (wildcards), whitespace, or other control characters (NUL among
/// them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InvalidToken {
    /// The token is the empty string.
    Empty,
    /// The token is longer than [`MAX_TOKEN_BYTES`]; the field holds its length in bytes.
    TooLong(usize),
    /// The token contains `.`, which would split it into two tokens.
    Separator,
    /// The token contains the wildcard `*` or `>`.
    Wildcard(char),
    /// The token contains a whitespace character, where the protocol splits its fields.
    Whitespace(char),
    /// The token contains a control character such as NUL.
    Control(char),
}

impl fmt::Display for InvalidToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("it is empty"),
            Self::TooLong(len) => write!(
                f,
                "it is {len} bytes long, over the limit of {MAX_TOKEN_BYTES} bytes a subject \
                 token may hold"
            ),
            Self::Separator => f.write_str("it contains '.', the NATS token separator"),
            Self::Wildcard(c) => write!(f, "it contains the NATS wildcard '{c}'"),
            Self::Whitespace(c) => write!(f, "it contains whitespace ({c:?})"),
            Self::Control(c) => write!(f, "it contains the control character {c:?}"),
        }
    }
}

/// Checks that `token` can stand as one token of a NATS subject.
///
/// # Errors
/// The first reason, scanning left to right, that makes `token` invalid.
pub fn validate_token(token: &str) -> Result<(), InvalidToken> {
    if token.is_empty() {
        return Err(InvalidToken::Empty);
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(InvalidToken::TooLong(token.len()));
    }
    // Printable ASCII other than the separator and the wildcards, by far the common case
    // (the relay checks each row's subject before it publishes it), needs no `char` decoding.
    if token
        .bytes()
        .all(|b| b.is_ascii_graphic() && !matches!(b, b'.' | b'*' | b'>'))
    {
        return Ok(());
    }
    validate_chars(token)
}

/// The token rule's character check, one `char` at a time.
fn validate_chars(token: &str) -> Result<(), InvalidToken> {
    for c in token.chars() {
        match c {
            '.' => return Err(InvalidToken::Separator),
            '*' | '>' => return Err(InvalidToken::Wildcard(c)),
            c if c.is_whitespace() => return Err(InvalidToken::Whitespace(c)),
            c if c.is_control() => return Err(InvalidToken::Control(c)),
            _ => {}
        }
    }
    Ok(())
}

/// A subject prefix that is not usable: the prefix is one or more valid tokens joined by `.`,
/// at most [`MAX_TOKEN_BYTES`] in all; its first token does not start with `$` (NATS reserves
/// `$JS`, `$SYS`, `$KV`, ...) and is not `_INBOX` (where clients receive replies).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("subject prefix {prefix:?} is not valid: {reason}")]
pub struct InvalidSubjectPrefix {
    /// The rejected prefix.
    pub prefix: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Checks a subject prefix such as `events` or `acme.orders`.
///
/// # Errors
/// [`InvalidSubjectPrefix`] naming the prefix and its first invalid token.
pub fn validate_prefix(prefix: &str) -> Result<(), InvalidSubjectPrefix> {
    let invalid = |reason: String| InvalidSubjectPrefix {
        prefix: prefix.to_owned(),
        reason,
    };
    if prefix.starts_with('$') {
        return Err(invalid(
            "subjects starting with '$' are reserved by NATS".to_owned(),
        ));
    }
    if prefix.split('.').next() == Some("_INBOX") {
        return Err(invalid(
            "_INBOX is where NATS clients receive replies; a stream capturing it would store \
             every request's reply"
                .to_owned(),
        ));
    }
    if prefix.len() > MAX_TOKEN_BYTES {
        return Err(invalid(format!(
            "it is {} bytes long, over the limit of {MAX_TOKEN_BYTES} bytes",
            prefix.len()
        )));
    }
    for (index, token) in prefix.split('.').enumerate() {
        validate_token(token)
            .map_err(|reason| invalid(format!("token {} ({token:?}): {reason}", index + 1)))?;
    }
    Ok(())
}

/// A subject filter NATS would not take, such as a consumer's `filter_subjects`: it is one or
/// more tokens joined by `.`, each a valid token ([`validate_token`]) or the wildcard `*`,
/// the last possibly `>`, at most [`MAX_SUBJECT_BYTES`] in all (NATS docs, "Subject-Based
/// Messaging", "Wildcards").
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("subject filter {filter:?} is not valid: {reason}")]
pub struct InvalidFilter {
    /// The rejected filter, cut to its first 128 bytes.
    pub filter: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Checks a NATS subject filter such as `events.Order.*.Placed` or `events.>`.
///
/// # Errors
/// [`InvalidFilter`] naming the filter and its first fault: its length, or the first token
/// (counted from 1) that is empty, holds whitespace, a control character or a wildcard
/// inside it, or is a `>` before the last.
pub fn validate_filter(filter: &str) -> Result<(), InvalidFilter> {
    let invalid = |reason: String| InvalidFilter {
        filter: shortened(filter, 128),
        reason,
    };
    if filter.len() > MAX_SUBJECT_BYTES {
        return Err(invalid(format!(
            "it is {} bytes long, over the limit of {MAX_SUBJECT_BYTES} bytes",
            filter.len()
        )));
    }
    let mut tokens = filter.split('.').enumerate().peekable();
    while let Some((index, token)) = tokens.next() {
        match token {
            "*" => {}
            ">" if tokens.peek().is_none() => {}
            ">" => {
                return Err(invalid(format!(
                    "token {} is '>', which stands only as the last token",
                    index + 1
                )));
            }
            _ => validate_token(token).map_err(|reason| {
                invalid(format!(
                    "token {} ({:?}): {reason}",
                    index + 1,
                    shortened(token, 64)
                ))
            })?,
        }
    }
    Ok(())
}

/// A name JetStream would not take for a stream, or would take to mean something else.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} is not a JetStream stream name: {reason}")]
pub struct InvalidStreamName {
    /// The rejected name, cut to its first 64 bytes.
    pub name: String,
    /// What is wrong with it.
    pub reason: String,
}

/// The most bytes of a stream name nats-server takes (2.9's error "stream name is too long,
/// maximum allowed is 255").
pub const MAX_STREAM_NAME_BYTES: usize = 255;

/// Checks a JetStream stream name such as `EVENTS`, as a relay, an inbox and `outbox tail`
/// do before they connect. NATS docs, "Naming Things": a stream name holds no whitespace,
/// `.`, `*`, `>`, path separator (nats-server stores a stream in a directory of its name) or
/// non-printable character, and is at most [`MAX_STREAM_NAME_BYTES`] long.
///
/// # Errors
/// [`InvalidStreamName`] naming the name and its first fault.
pub fn validate_stream_name(name: &str) -> Result<(), InvalidStreamName> {
    let invalid = |reason: String| InvalidStreamName {
        name: shortened(name, 64),
        reason,
    };
    if name.len() > MAX_STREAM_NAME_BYTES {
        return Err(invalid(format!(
            "it is {} bytes long, over nats-server's limit of {MAX_STREAM_NAME_BYTES}",
            name.len()
        )));
    }
    validate_token(name).map_err(|reason| invalid(reason.to_string()))?;
    if let Some(separator) = name.chars().find(|c| matches!(c, '/' | '\\')) {
        return Err(invalid(format!(
            "it contains the path separator {separator:?}"
        )));
    }
    Ok(())
}

/// A subject the relay will not publish: a row's `subject` must lie under the relay's own
/// `{prefix}.`, with valid tokens, within [`MAX_SUBJECT_BYTES`]. Anything else (a JetStream
/// API subject such as `$JS.API.STREAM.PURGE.X`, a wildcard, a space) would reach another
/// stream, the server's API or nowhere.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("subject {subject:?} is not publishable: {reason}")]
pub struct InvalidSubject {
    /// The rejected subject, cut to its first 128 bytes.
    pub subject: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Checks that the relay may publish `subject` for an outbox whose prefix is `prefix`
/// (itself valid): `{prefix}.` followed by one or more valid tokens, at most
/// [`MAX_SUBJECT_BYTES`] in all.
///
/// # Errors
/// [`InvalidSubject`] naming the first thing wrong.
pub fn validate_subject(subject: &str, prefix: &str) -> Result<(), InvalidSubject> {
    let invalid = |reason: String| InvalidSubject {
        subject: shortened(subject, 128),
        reason,
    };
    if subject.len() > MAX_SUBJECT_BYTES {
        return Err(invalid(format!(
            "it is {} bytes long, over the limit of {MAX_SUBJECT_BYTES} bytes (nats-server \
             closes the connection of a client whose control line exceeds 4,096 bytes)",
            subject.len()
        )));
    }
    let rest = subject
        .strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix('.'))
        .ok_or_else(|| {
            invalid(format!(
                "it does not start with the relay's prefix \"{prefix}.\""
            ))
        })?;
    for (index, token) in rest.split('.').enumerate() {
        validate_token(token).map_err(|reason| {
            invalid(format!(
                "token {} after the prefix ({:?}): {reason}",
                index + 1,
                shortened(token, 64)
            ))
        })?;
    }
    Ok(())
}

/// At most `max` bytes of `text`, cut at a character boundary, with `...` when cut.
pub(crate) fn shortened(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// The default subject of an event: `{prefix}.{aggregate_type}.{partition_key}.{event_type}`.
///
/// The caller has validated every part; this only joins them.
pub(crate) fn event_subject(
    prefix: &str,
    aggregate_type: &str,
    partition_key: &str,
    event_type: &str,
) -> String {
    let mut subject = String::with_capacity(
        prefix.len() + aggregate_type.len() + partition_key.len() + event_type.len() + 3,
    );
    for (i, part) in [prefix, aggregate_type, partition_key, event_type]
        .into_iter()
        .enumerate()
    {
        if i > 0 {
            subject.push('.');
        }
        subject.push_str(part);
    }
    subject
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same table as `outbox-derive/src/valid.rs`, messages included: the compile-time
    /// and the commit-time checks must agree.
    #[test]
    fn token_rule() {
        let cases: &[(&str, Option<&str>)] = &[
            ("Order", None),
            ("order-42_x", None),
            ("Bestellung\u{e4}", None),
            ("$weird", None),
            ("", Some("it is empty")),
            ("a.b", Some("it contains '.', the NATS token separator")),
            ("a*", Some("it contains the NATS wildcard '*'")),
            (">", Some("it contains the NATS wildcard '>'")),
            ("a b", Some("it contains whitespace (' ')")),
            ("a\tb", Some("it contains whitespace ('\\t')")),
            ("a\r\n", Some("it contains whitespace ('\\r')")),
            ("a\u{a0}b", Some("it contains whitespace ('\\u{a0}')")),
            ("a\0", Some("it contains the control character '\\0'")),
            (
                &"x".repeat(257),
                Some("it is 257 bytes long, over the limit of 256 bytes a subject token may hold"),
            ),
        ];
        for (token, expected) in cases {
            let reason = validate_token(token).err().map(|e| e.to_string());
            assert_eq!(reason.as_deref(), *expected, "token {token:?}");
        }
        assert_eq!(validate_token("a.b"), Err(InvalidToken::Separator));
    }

    /// The ASCII fast path accepts exactly the tokens the `char` check accepts.
    #[test]
    fn the_ascii_fast_path_agrees_with_the_char_check() {
        for byte in 0_u8..=127 {
            let token = format!("a{}b", char::from(byte));
            assert_eq!(
                validate_token(&token),
                validate_chars(&token),
                "token {token:?}"
            );
        }
    }

    #[test]
    fn prefix_rule() {
        assert!(validate_prefix("events").is_ok());
        assert!(validate_prefix("acme.orders").is_ok());
        let err = validate_prefix("acme..orders").unwrap_err();
        assert_eq!(err.reason, "token 2 (\"\"): it is empty");
        let err = validate_prefix("$JS.events").unwrap_err();
        assert!(err.reason.contains("reserved"), "{err}");
        let err = validate_prefix("_INBOX.orders").unwrap_err();
        assert!(err.reason.contains("replies"), "{err}");
        assert!(validate_prefix("_INBOXES").is_ok());
        let err = validate_prefix(&"p".repeat(257)).unwrap_err();
        assert!(err.reason.contains("257 bytes"), "{err}");
        let err = validate_prefix("events.>").unwrap_err();
        assert_eq!(
            err.to_string(),
            "subject prefix \"events.>\" is not valid: token 2 (\">\"): it contains the NATS wildcard '>'"
        );
    }

    #[test]
    fn only_subjects_under_the_prefix_with_valid_tokens_are_publishable() {
        assert!(validate_subject("events.Order.o-1.Placed", "events").is_ok());
        assert!(validate_subject("acme.orders.Order.o-1.Placed", "acme.orders").is_ok());
        for (subject, reason) in [
            (
                "$JS.API.STREAM.PURGE.OTHER",
                "does not start with the relay's prefix",
            ),
            ("eventsX.Order", "does not start with the relay's prefix"),
            ("events", "does not start with the relay's prefix"),
            ("events.", "token 1 after the prefix (\"\"): it is empty"),
            (
                "events.Order.a b.Placed",
                "token 2 after the prefix (\"a b\"): it contains whitespace",
            ),
            ("events.Order.*.Placed", "wildcard '*'"),
            (
                "events.Order..Placed",
                "token 2 after the prefix (\"\"): it is empty",
            ),
        ] {
            let error = validate_subject(subject, "events").unwrap_err();
            assert!(error.reason.contains(reason), "{subject}: {error}");
        }
        let long = format!("events.Order.{}.Placed", "x".repeat(1100));
        let error = validate_subject(&long, "events").unwrap_err();
        assert!(
            error.reason.contains("over the limit of 1024 bytes"),
            "{error}"
        );
        assert_eq!(
            error.subject.len(),
            128 + 3,
            "the error carries a shortened subject"
        );
    }

    #[test]
    fn stream_names_are_one_printable_token_without_a_path_separator() {
        for name in ["EVENTS", "orders-v2", "a_b", &"S".repeat(255)] {
            assert_eq!(validate_stream_name(name), Ok(()), "{name}");
        }
        for (name, reason) in [
            ("", "it is empty"),
            ("ORDERS AND MORE", "whitespace"),
            ("ORDERS.V2", "'.'"),
            ("ORDERS*", "'*'"),
            ("ORDERS>", "'>'"),
            ("ORDERS/V2", "the path separator '/'"),
            ("ORDERS\\V2", "the path separator '\\\\'"),
            ("ORDERS\u{0}", "control character"),
        ] {
            let error = validate_stream_name(name).unwrap_err();
            assert_eq!(error.name, name);
            assert!(error.reason.contains(reason), "{name:?}: {}", error.reason);
            assert!(
                error.to_string().contains("is not a JetStream stream name"),
                "{error}"
            );
        }
        let long = "S".repeat(256);
        let error = validate_stream_name(&long).unwrap_err();
        assert_eq!(
            error.reason,
            "it is 256 bytes long, over nats-server's limit of 255"
        );
        assert_eq!(error.name, format!("{}...", &long[..64]));
    }

    #[test]
    fn filters_take_whole_token_wildcards_and_a_last_greater_than() {
        for filter in [
            "events.>",
            ">",
            "*",
            "events.Order.*.Placed",
            "*.Order.>",
            "events.Order.o-1.Placed",
        ] {
            assert_eq!(validate_filter(filter), Ok(()), "{filter}");
        }
        for (filter, reason) in [
            ("", "token 1 (\"\"): it is empty"),
            ("events..Placed", "token 2 (\"\"): it is empty"),
            ("events.", "token 2 (\"\"): it is empty"),
            (".events", "token 1 (\"\"): it is empty"),
            (
                "events.>.Placed",
                "token 2 is '>', which stands only as the last token",
            ),
            (">.>", "token 1 is '>'"),
            (
                "events.o*",
                "token 2 (\"o*\"): it contains the NATS wildcard '*'",
            ),
            (
                "events.**",
                "token 2 (\"**\"): it contains the NATS wildcard '*'",
            ),
            (
                "events.a>",
                "token 2 (\"a>\"): it contains the NATS wildcard '>'",
            ),
            (
                "events.Order ",
                "token 2 (\"Order \"): it contains whitespace",
            ),
            ("events.\u{7}", "control character"),
        ] {
            let error = validate_filter(filter).unwrap_err();
            assert_eq!(error.filter, filter);
            assert!(error.reason.contains(reason), "{filter:?}: {error}");
        }
        let long = format!("events.{}", "x".repeat(1100));
        let error = validate_filter(&long).unwrap_err();
        assert!(
            error.reason.contains("over the limit of 1024 bytes"),
            "{error}"
        );
    }

    #[test]
    fn subject_joins_four_parts() {
        assert_eq!(
            event_subject("events", "Order", "42", "Placed"),
            "events.Order.42.Placed"
        );
    }
}
