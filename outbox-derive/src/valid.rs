//! Every check of the macros' input, each error on the exact token that is wrong.

use std::collections::HashMap;

use syn::{Fields, GenericParam, LitInt, LitStr};

use crate::ast::{AggregateInput, Event, EventKind, EventSet, EventType};
use crate::attr::{self, Errors, UpcastStep};

/// Why `token` cannot be a NATS subject token, or `None` when it can.
///
/// The same rule as `outbox_runtime::subject::validate_token` (this crate cannot depend on
/// that one); the tests of both pin the same cases.
pub fn token_error(token: &str) -> Option<String> {
    /// `outbox_runtime::subject::MAX_TOKEN_BYTES`.
    const MAX_TOKEN_BYTES: usize = 256;
    if token.is_empty() {
        return Some("it is empty".to_owned());
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Some(format!(
            "it is {} bytes long, over the limit of {MAX_TOKEN_BYTES} bytes a subject token may hold",
            token.len()
        ));
    }
    token.chars().find_map(|c| match c {
        '.' => Some("it contains '.', the NATS token separator".to_owned()),
        '*' | '>' => Some(format!("it contains the NATS wildcard '{c}'")),
        c if c.is_whitespace() => Some(format!("it contains whitespace ({c:?})")),
        c if c.is_control() => Some(format!("it contains the control character {c:?}")),
        _ => None,
    })
}

fn check_name(literal: &LitStr, what: &str, errors: &mut Errors) {
    let value = literal.value();
    if let Some(reason) = token_error(&value) {
        // A long name is shown by its start: the span points at all of it.
        let shown = match value.char_indices().nth(40) {
            Some((end, _)) => format!("{:?}...", &value[..end]),
            None => format!("{value:?}"),
        };
        errors.push(syn::Error::new_spanned(
            literal,
            format!("{what} {shown} is not a valid NATS subject token: {reason}"),
        ));
    }
}

/// The version as written, when it is a valid one (1 to `i32::MAX`).
pub fn version(literal: &LitInt, errors: &mut Errors) -> Option<i32> {
    match literal.base10_parse::<i32>() {
        Ok(version) if version >= 1 => Some(version),
        _ => {
            errors.push(syn::Error::new_spanned(
                literal,
                "an event version is a whole number from 1 to 2147483647 (the `event_version` \
                 column is a PostgreSQL integer)",
            ));
            None
        }
    }
}

pub fn event(event: &Event<'_>, errors: &mut Errors) {
    for param in &event.input.generics.params {
        if let GenericParam::Lifetime(lifetime) = param {
            errors.push(syn::Error::new_spanned(
                lifetime,
                "an event owns its data ('static): remove the lifetime parameter and use owned \
                 fields",
            ));
        }
    }
    match &event.kind {
        EventKind::Struct(event_type) => {
            if let Fields::Unnamed(fields) = event_type.fields {
                errors.push(syn::Error::new_spanned(
                    fields,
                    "DomainEvent needs named fields: the payload is a JSON object keyed by field \
                     name; write `struct Name { field: Type }`",
                ));
            }
        }
        EventKind::Enum(variants) => {
            if variants.is_empty() {
                errors.push(syn::Error::new_spanned(
                    &event.input.ident,
                    "an event enum needs at least one variant, one per event type",
                ));
            }
            for key in attr::serde_keys(&event.input.attrs) {
                if ["tag", "content", "untagged"]
                    .iter()
                    .any(|k| key.is_ident(k))
                {
                    errors.push(syn::Error::new_spanned(
                        &key,
                        "DomainEvent sends the event type in `ce-type` and the variant's own JSON \
                         as the payload, so it needs serde's default enum representation; \
                         remove this serde attribute",
                    ));
                }
            }
            for variant in variants {
                check_variant(variant, errors);
            }
        }
    }
    let mut seen: HashMap<(String, i32), &EventType<'_>> = HashMap::new();
    for event_type in event.event_types() {
        match (&event_type.name, &event_type.serde_name) {
            (Some(name), _) => check_name(name, "event type name", errors),
            (None, Some(name)) => check_name(name, "event type name (serde's)", errors),
            (None, None) => {}
        }
        let version = match &event_type.version {
            Some(literal) => version(literal, errors),
            None => Some(1),
        };
        if let [_, second, ..] = event_type.partition_keys.as_slice() {
            errors.push(syn::Error::new_spanned(
                &second.attr,
                "partition_key is set twice; keep one #[event(partition_key)] field",
            ));
        }
        if let [_, second, ..] = event_type.dedup_keys.as_slice() {
            errors.push(syn::Error::new_spanned(
                &second.attr,
                "dedup_key is set twice; keep one #[event(dedup_key)] field",
            ));
        }
        if let Some(version) = version
            && let Some(first) = seen.insert((event_type.name(), version), event_type)
        {
            let message = format!(
                "event type {:?} version {version} is already carried by variant `{}`; give \
                     this variant another #[event(name)] or #[event(version)]",
                event_type.name(),
                first.ident
            );
            match event_type.name.as_ref().or(event_type.serde_name.as_ref()) {
                Some(name) => errors.push(syn::Error::new_spanned(name, message)),
                None => errors.push(syn::Error::new_spanned(event_type.ident, message)),
            }
        }
    }
    // The older versions each event type reads through its upcasters: no other variant may
    // carry them (the decode would have two ways to go).
    for event_type in event.event_types() {
        let version = match &event_type.version {
            Some(literal) => literal.base10_parse::<i32>().ok().filter(|v| *v >= 1),
            None => Some(1),
        };
        let Some(version) = version else { continue };
        for (from, literal) in upcasts(event_type, version, errors) {
            if let Some(first) = seen.insert((event_type.name(), from), event_type) {
                errors.push(syn::Error::new_spanned(
                    literal,
                    format!(
                        "event type {:?} version {from} is already read by variant `{}`; a \
                         message of that version could decode two ways: remove this upcast or \
                         that variant",
                        event_type.name(),
                        first.ident
                    ),
                ));
            }
        }
    }
}

/// Checks the `upcast(..)` entries of one event type at `version`, and returns the versions
/// they read with their `from` literals. The chain must be whole: from its lowest version,
/// every version below `version` has exactly one upcaster, so each older payload reaches the
/// current type one version at a time.
pub fn upcasts<'e>(
    event_type: &'e EventType<'_>,
    version: i32,
    errors: &mut Errors,
) -> Vec<(i32, &'e LitInt)> {
    let mut steps: Vec<(i32, &LitInt, &UpcastStep)> = Vec::new();
    for upcast in &event_type.upcasts {
        let Some(literal) = &upcast.from else {
            errors.push(syn::Error::new_spanned(
                &upcast.key,
                "this upcast needs `from = N`: the version whose payloads it reads",
            ));
            continue;
        };
        let Some(step) = &upcast.step else {
            errors.push(syn::Error::new_spanned(
                &upcast.key,
                "this upcast needs `json = function` (version N's JSON to version N + 1's) or \
                 `type = OldType` (version N's payload type)",
            ));
            continue;
        };
        let from = match literal.base10_parse::<i32>() {
            Ok(from) if (1..version).contains(&from) => from,
            _ if version == 1 => {
                errors.push(syn::Error::new_spanned(
                    literal,
                    "this event type is at version 1 and has no older version to read: raise \
                     its #[event(version = N)] above the versions it upcasts",
                ));
                continue;
            }
            _ => {
                errors.push(syn::Error::new_spanned(
                    literal,
                    format!(
                        "an upcast reads an older version: `from` is a whole number from 1 to \
                         {} (this event type is at version {version})",
                        version - 1
                    ),
                ));
                continue;
            }
        };
        if steps.iter().any(|(earlier, ..)| *earlier == from) {
            errors.push(syn::Error::new_spanned(
                literal,
                format!("version {from} already has an upcast; keep one per version"),
            ));
            continue;
        }
        steps.push((from, literal, step));
    }
    for (from, literal, step) in &steps {
        let next = from + 1;
        if next == version {
            continue;
        }
        match steps.iter().find(|(other, ..)| *other == next) {
            None => errors.push(syn::Error::new_spanned(
                literal,
                format!(
                    "upcast from {from} yields version {next}, and nothing upcasts version \
                     {next}: add #[event(upcast(from = {next}, ..))] so it reaches version \
                     {version}"
                ),
            )),
            Some((.., UpcastStep::Json(_))) if step.is_type() => {
                let UpcastStep::Type(ty) = step else {
                    unreachable!("is_type")
                };
                errors.push(syn::Error::new_spanned(
                    ty,
                    format!(
                        "a typed upcast converts into version {next}'s type, and version {next} \
                         has none (its upcast is `json`): give upcast(from = {next}) a \
                         `type = ..`, or make this one `json`"
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    steps
        .into_iter()
        .map(|(from, literal, _)| (from, literal))
        .collect()
}

fn check_variant(variant: &EventType<'_>, errors: &mut Errors) {
    if let Fields::Unnamed(fields) = variant.fields
        && fields.unnamed.len() != 1
    {
        errors.push(syn::Error::new_spanned(
            fields,
            "an event variant has named fields, one unnamed field (its payload type), or \
                 none; several unnamed fields have no JSON object shape",
        ));
    }
    for key in &variant.serde_keys {
        let refused = [
            "skip",
            "skip_serializing",
            "skip_deserializing",
            "other",
            "untagged",
        ];
        if refused.iter().any(|k| key.is_ident(k)) {
            errors.push(syn::Error::new_spanned(
                key,
                "every variant of a DomainEvent enum is an event type that must serialize and \
                 deserialize; remove this serde attribute",
            ));
        }
    }
}

pub fn aggregate(input: &AggregateInput, errors: &mut Errors) {
    if let Some(name) = &input.name {
        check_name(name, "aggregate type name", errors);
    }
    for derive in attr::derives(&input.item.attrs) {
        let name = attr::last_segment(&derive);
        if ["Queryable", "Selectable", "QueryableByName"].contains(&name.as_str()) {
            errors.push(syn::Error::new_spanned(
                &derive,
                format!(
                    "diesel's {name} maps every field to a column, and the aggregate's \
                     `PendingEvents` field has none; derive {name} on a row struct and build \
                     the aggregate from it"
                ),
            ));
        }
    }
}

pub fn event_set(set: &EventSet<'_>, errors: &mut Errors) {
    let input = set.input;
    if let Some(param) = input.generics.params.first() {
        errors.push(syn::Error::new_spanned(
            param,
            "an event set has no generic parameters: name its event types",
        ));
    }
    if set.members.is_empty() {
        errors.push(syn::Error::new_spanned(
            &input.ident,
            "an event set needs at least one variant: `Account(AccountEvent)`",
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::token_error;

    /// The same table as `outbox_runtime::subject`'s tests: the two rules must agree.
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
            assert_eq!(token_error(token).as_deref(), *expected, "token {token:?}");
        }
    }
}
