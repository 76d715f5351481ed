//! Attribute parsing only: `#[event(..)]`, `#[aggregate(..)]`, `#[aggregate_id]`, and the
//! `#[serde(..)]` and `#[derive(..)]` keys that the checks look at.

use proc_macro2::TokenStream;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{Attribute, LitInt, LitStr, Meta, Path, Token, Type};

/// Errors collected across the input, reported together (`syn::Error::combine`).
#[derive(Default)]
pub struct Errors(Option<syn::Error>);

impl Errors {
    pub fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// Where an `#[event(..)]` attribute stands, which decides the keys it takes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// On a struct: one event type.
    Struct,
    /// On an enum: nothing; each variant is an event type.
    Enum,
    /// On an enum variant: one event type.
    Variant,
    /// On a field: the partition key.
    Field,
}

/// The keys of the `#[event(..)]` attributes at one place.
#[derive(Default)]
pub struct EventAttrs {
    /// `name = "..."`: the event type name.
    pub name: Option<LitStr>,
    /// `version = N`: the payload version.
    pub version: Option<LitInt>,
    /// `partition_key`: this field is the partition key (the path, for its span).
    pub partition_key: Option<Path>,
    /// `dedup_key`: this field is the producer's dedup key (the path, for its span).
    pub dedup_key: Option<Path>,
    /// `upcast(from = N, ..)`, each one given, in order.
    pub upcasts: Vec<Upcast>,
}

/// `upcast(from = N, json = path)` or `upcast(from = N, type = OldType)`: how a payload of
/// version N becomes one of version N + 1.
pub struct Upcast {
    /// The `upcast` token, for errors about the whole entry.
    pub key: Path,
    /// `from = N`.
    pub from: Option<LitInt>,
    /// `json = ..` or `type = ..`; `None` when neither was given.
    pub step: Option<UpcastStep>,
}

/// How one version becomes the next.
pub enum UpcastStep {
    /// `json = path`: a function from version N's JSON to version N + 1's.
    Json(Path),
    /// `type = T`: version N's payload is a `T`, and version N + 1's type implements
    /// `From<T>`.
    Type(Box<Type>),
}

impl UpcastStep {
    pub fn is_type(&self) -> bool {
        matches!(self, Self::Type(_))
    }
}

pub fn event_attrs(attrs: &[Attribute], place: Place, errors: &mut Errors) -> EventAttrs {
    let mut parsed = EventAttrs::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("event")) {
        if place == Place::Enum {
            errors.push(syn::Error::new_spanned(
                attr,
                "#[event(..)] does not go on an enum; put #[event(name = \"..\", version = N)] \
                 on the variant it describes",
            ));
            continue;
        }
        let result = attr.parse_nested_meta(|meta| {
            let key = &meta.path;
            let expected = match place {
                Place::Field => "on a field it takes `partition_key` and `dedup_key`",
                _ => {
                    "on a struct or variant it takes `name = \"..\"`, `version = N` and \
                     `upcast(from = N, json = function)` or `upcast(from = N, type = OldType)`"
                }
            };
            if key.is_ident("partition_key") && place == Place::Field {
                if parsed.partition_key.is_some() {
                    return Err(meta.error("`partition_key` is set twice on this field"));
                }
                parsed.partition_key = Some(key.clone());
            } else if key.is_ident("dedup_key") && place == Place::Field {
                if parsed.dedup_key.is_some() {
                    return Err(meta.error("`dedup_key` is set twice on this field"));
                }
                parsed.dedup_key = Some(key.clone());
            } else if key.is_ident("name") && place != Place::Field {
                let value: LitStr = meta.value()?.parse()?;
                if parsed.name.is_some() {
                    return Err(syn::Error::new_spanned(key, "`name` is set twice"));
                }
                parsed.name = Some(value);
            } else if key.is_ident("version") && place != Place::Field {
                let value: LitInt = meta.value()?.parse()?;
                if parsed.version.is_some() {
                    return Err(syn::Error::new_spanned(key, "`version` is set twice"));
                }
                parsed.version = Some(value);
            } else if key.is_ident("upcast") && place != Place::Field {
                parsed.upcasts.push(upcast(&meta)?);
            } else if key.is_ident("partition_key") {
                return Err(meta.error(
                    "`partition_key` belongs on a field: #[event(partition_key)] on the field \
                     whose value partitions this event",
                ));
            } else if key.is_ident("dedup_key") {
                return Err(meta.error(
                    "`dedup_key` belongs on a field: #[event(dedup_key)] on the field whose \
                     value is this event's idempotency key",
                ));
            } else if key.is_ident("name") || key.is_ident("version") || key.is_ident("upcast") {
                return Err(meta.error(format!(
                    "`{}` belongs on the struct or variant, not on a field",
                    path_text(key)
                )));
            } else {
                return Err(meta.error(format!(
                    "unknown key `{}` in #[event(..)]; {expected}",
                    path_text(key)
                )));
            }
            Ok(())
        });
        if let Err(error) = result {
            errors.push(error);
        }
    }
    parsed
}

/// The inside of `upcast(..)`.
fn upcast(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<Upcast> {
    let mut upcast = Upcast {
        key: meta.path.clone(),
        from: None,
        step: None,
    };
    meta.parse_nested_meta(|inner| {
        let key = &inner.path;
        if key.is_ident("from") {
            if upcast.from.is_some() {
                return Err(inner.error("`from` is set twice in this upcast"));
            }
            upcast.from = Some(inner.value()?.parse()?);
        } else if key.is_ident("json") || key.is_ident("type") {
            let step = if key.is_ident("json") {
                UpcastStep::Json(inner.value()?.parse()?)
            } else {
                UpcastStep::Type(Box::new(inner.value()?.parse()?))
            };
            if upcast.step.is_some() {
                return Err(inner
                    .error("an upcast takes one of `json = function` and `type = OldType`, once"));
            }
            upcast.step = Some(step);
        } else {
            return Err(inner.error(format!(
                "unknown key `{}` in upcast(..); it takes `from = N` and one of \
                 `json = function` (version N's JSON to version N + 1's) and `type = OldType` \
                 (version N's payload type, which version N + 1's type converts `From`)",
                path_text(key)
            )));
        }
        Ok(())
    })?;
    Ok(upcast)
}

/// The arguments of `#[aggregate(..)]`.
#[derive(Default)]
pub struct AggregateArgs {
    /// `name = "..."`: the aggregate type name.
    pub name: Option<LitStr>,
}

pub fn aggregate_args(args: TokenStream, errors: &mut Errors) -> AggregateArgs {
    let mut parsed = AggregateArgs::default();
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("event") {
            return Err(meta.error(
                "the event type is the one of the aggregate's `PendingEvents<EventType>` \
                 field; remove `event = ..`",
            ));
        } else if meta.path.is_ident("name") {
            if parsed.name.is_some() {
                return Err(meta.error("`name` is set twice"));
            }
            parsed.name = Some(meta.value()?.parse()?);
        } else {
            return Err(meta.error(format!(
                "unknown #[aggregate] argument `{}`; it takes `name = \"..\"`",
                path_text(&meta.path)
            )));
        }
        Ok(())
    });
    if let Err(error) = parser.parse2(args) {
        errors.push(error);
    }
    parsed
}

/// Whether `attr` is `#[aggregate_id]`; a malformed one is an error.
pub fn is_aggregate_id(attr: &Attribute, errors: &mut Errors) -> bool {
    if !attr.path().is_ident("aggregate_id") {
        return false;
    }
    if !matches!(attr.meta, Meta::Path(_)) {
        errors.push(syn::Error::new_spanned(
            &attr.meta,
            "#[aggregate_id] takes no arguments; it marks the field that holds the id",
        ));
    }
    true
}

/// The top-level keys of every `#[serde(..)]` attribute, as paths (for their spans).
/// An attribute that does not parse is left to serde to report.
pub fn serde_keys(attrs: &[Attribute]) -> Vec<Path> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("serde"))
        .filter_map(|a| {
            a.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
                .ok()
        })
        .flatten()
        .map(|meta| meta.path().clone())
        .collect()
}

/// The name serde gives a struct or a variant (`key` = `rename`), or the variants of an enum
/// (`key` = `rename_all`): `#[serde(rename = "..")]`. It names the event type when
/// `#[event(name)]` does not. The `rename(serialize = .., deserialize = ..)` form is refused
/// with a message: an event type has one name.
pub fn serde_rename(attrs: &[Attribute], key: &str, errors: &mut Errors) -> Option<LitStr> {
    let mut found = None;
    for attr in attrs.iter().filter(|a| a.path().is_ident("serde")) {
        let Ok(metas) = attr.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
        else {
            continue;
        };
        for meta in metas.iter().filter(|m| m.path().is_ident(key)) {
            match meta {
                Meta::NameValue(syn::MetaNameValue {
                    value:
                        syn::Expr::Lit(syn::ExprLit {
                            lit: syn::Lit::Str(name),
                            ..
                        }),
                    ..
                }) => found = Some(name.clone()),
                // serde reports a malformed value itself.
                Meta::NameValue(_) => {}
                other => errors.push(syn::Error::new_spanned(
                    other,
                    format!(
                        "an event type has one name, and DomainEvent takes it from serde's \
                         `{key} = \"..\"`; with separate serialize and deserialize names, set \
                         #[event(name = \"..\")] on each event type instead"
                    ),
                )),
            }
        }
    }
    found
}

/// The paths inside every `#[derive(..)]` attribute.
pub fn derives(attrs: &[Attribute]) -> Vec<Path> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("derive"))
        .filter_map(|a| {
            a.parse_args_with(Punctuated::<Path, Token![,]>::parse_terminated)
                .ok()
        })
        .flatten()
        .collect()
}

/// The last segment of a path, as written (`serde::Serialize` -> `Serialize`).
pub fn last_segment(path: &Path) -> String {
    path.segments
        .last()
        .map(|s| s.ident.to_string())
        .unwrap_or_default()
}

fn path_text(path: &Path) -> String {
    path.segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect::<Vec<_>>()
        .join("::")
}
