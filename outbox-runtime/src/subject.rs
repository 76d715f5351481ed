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
//! `outbox-derive/src/valid.rs` applies the same rule at compile time (a proc-macro crate
//! cannot call this one); the tests of both pin the same cases.

use std::fmt;

/// Why a string is not a valid NATS subject token.
///
/// A token is non-empty and contains none of `.` (the separator), `*` and `>` (wildcards),
/// whitespace, or other control characters (NUL among them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InvalidToken {
    /// The token is the empty string.
    Empty,
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
/// and its first token does not start with `$` (NATS reserves `$JS`, `$SYS`, `$KV`, ...).
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
    for (index, token) in prefix.split('.').enumerate() {
        validate_token(token)
            .map_err(|reason| invalid(format!("token {} ({token:?}): {reason}", index + 1)))?;
    }
    Ok(())
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
        ];
        for (token, expected) in cases {
            let reason = validate_token(token).err().map(|e| e.to_string());
            assert_eq!(reason.as_deref(), *expected, "token {token:?}");
        }
        assert_eq!(validate_token("a.b"), Err(InvalidToken::Separator));
    }

    #[test]
    fn prefix_rule() {
        assert!(validate_prefix("events").is_ok());
        assert!(validate_prefix("acme.orders").is_ok());
        let err = validate_prefix("acme..orders").unwrap_err();
        assert_eq!(err.reason, "token 2 (\"\"): it is empty");
        let err = validate_prefix("$JS.events").unwrap_err();
        assert!(err.reason.contains("reserved"), "{err}");
        let err = validate_prefix("events.>").unwrap_err();
        assert_eq!(
            err.to_string(),
            "subject prefix \"events.>\" is not valid: token 2 (\">\"): it contains the NATS wildcard '>'"
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
