//! The macros' input as a typed model, attributes already parsed.
//!
//! Building the model reports what makes it impossible to build (a union, a missing id
//! field); everything else is checked in `valid.rs`.

use proc_macro2::TokenStream;
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, Ident, ItemStruct, LitInt, LitStr, Member, Path, Type};

use crate::attr::{self, Errors, Place};

/// The input of `#[derive(DomainEvent)]`.
pub struct Event<'a> {
    pub input: &'a DeriveInput,
    pub kind: EventKind<'a>,
}

pub enum EventKind<'a> {
    /// A struct: one event type.
    Struct(EventType<'a>),
    /// An enum: one event type per variant, in declaration order.
    Enum(Vec<EventType<'a>>),
}

/// One event type: a struct, or one variant of an enum.
pub struct EventType<'a> {
    /// The struct or variant name.
    pub ident: &'a Ident,
    /// `#[event(name = "..")]`, if given.
    pub name: Option<LitStr>,
    /// serde's name for it, if serde renames it: the struct's or the variant's
    /// `#[serde(rename = "..")]`, or the enum's `rename_all` rule applied to the variant
    /// (spanned on the rule). The name when `name` is not given.
    pub serde_name: Option<LitStr>,
    /// `#[event(version = N)]`, if given.
    pub version: Option<LitInt>,
    /// `#[event(upcast(..))]`, in the order given: how older versions become this one.
    pub upcasts: Vec<attr::Upcast>,
    pub fields: &'a Fields,
    /// The fields marked `#[event(partition_key)]`: one is expected.
    pub partition_keys: Vec<PartitionKey>,
    /// The fields marked `#[event(dedup_key)]`: at most one is expected.
    pub dedup_keys: Vec<PartitionKey>,
    /// The variant's position among the enum's variants (serde's variant index).
    pub index: u32,
    /// The keys of the variant's `#[serde(..)]` attributes.
    pub serde_keys: Vec<Path>,
}

/// A field marked `#[event(partition_key)]` or `#[event(dedup_key)]`.
pub struct PartitionKey {
    pub member: Member,
    /// The `partition_key` or `dedup_key` token of the attribute.
    pub attr: Path,
}

impl EventType<'_> {
    /// The event type name: `#[event(name)]`, else serde's name for the struct or variant
    /// (`#[serde(rename)]`, or the enum's `#[serde(rename_all)]`), else its Rust name.
    pub fn name(&self) -> String {
        match (&self.name, &self.serde_name) {
            (Some(name), _) | (None, Some(name)) => name.value(),
            (None, None) => self.ident.unraw().to_string(),
        }
    }
}

impl<'a> Event<'a> {
    pub fn from_input(input: &'a DeriveInput, errors: &mut Errors) -> Option<Self> {
        let kind = match &input.data {
            Data::Struct(data) => {
                let attrs = attr::event_attrs(&input.attrs, Place::Struct, errors);
                let serde_name = attr::serde_rename(&input.attrs, "rename", errors);
                let mut event_type =
                    event_type(&input.ident, attrs, &data.fields, 0, vec![], errors);
                event_type.serde_name = serde_name;
                EventKind::Struct(event_type)
            }
            Data::Enum(data) => {
                attr::event_attrs(&input.attrs, Place::Enum, errors);
                let rule = attr::serde_rename(&input.attrs, "rename_all", errors);
                let mut variants = Vec::with_capacity(data.variants.len());
                for (index, variant) in data.variants.iter().enumerate() {
                    let attrs = attr::event_attrs(&variant.attrs, Place::Variant, errors);
                    let index = u32::try_from(index).expect("fewer than 2^32 variants");
                    let serde_keys = attr::serde_keys(&variant.attrs);
                    let renamed = attr::serde_rename(&variant.attrs, "rename", errors);
                    let mut event_type = event_type(
                        &variant.ident,
                        attrs,
                        &variant.fields,
                        index,
                        serde_keys,
                        errors,
                    );
                    event_type.serde_name = renamed.or_else(|| {
                        let rule = rule.as_ref()?;
                        let name =
                            rename_variant(&rule.value(), &variant.ident.unraw().to_string())?;
                        Some(LitStr::new(&name, rule.span()))
                    });
                    variants.push(event_type);
                }
                EventKind::Enum(variants)
            }
            Data::Union(data) => {
                errors.push(syn::Error::new_spanned(
                    data.union_token,
                    "DomainEvent cannot be derived for a union: an event is a struct with named \
                     fields, or an enum with one variant per event type",
                ));
                return None;
            }
        };
        Some(Self { input, kind })
    }

    pub fn event_types(&self) -> &[EventType<'a>] {
        match &self.kind {
            EventKind::Struct(event_type) => std::slice::from_ref(event_type),
            EventKind::Enum(variants) => variants,
        }
    }
}

fn event_type<'a>(
    ident: &'a Ident,
    attrs: attr::EventAttrs,
    fields: &'a Fields,
    index: u32,
    serde_keys: Vec<Path>,
    errors: &mut Errors,
) -> EventType<'a> {
    let mut partition_keys = Vec::new();
    let mut dedup_keys = Vec::new();
    for (member, field) in fields.members().zip(fields.iter()) {
        let attrs = attr::event_attrs(&field.attrs, Place::Field, errors);
        if let Some(attr) = attrs.partition_key {
            partition_keys.push(PartitionKey {
                member: member.clone(),
                attr,
            });
        }
        if let Some(attr) = attrs.dedup_key {
            dedup_keys.push(PartitionKey { member, attr });
        }
    }
    EventType {
        ident,
        name: attrs.name,
        serde_name: None,
        version: attrs.version,
        upcasts: attrs.upcasts,
        fields,
        partition_keys,
        dedup_keys,
        index,
        serde_keys,
    }
}

/// A variant's name under serde's `rename_all` rule, as serde applies it to variants; `None`
/// for a rule serde does not know (serde reports it).
fn rename_variant(rule: &str, variant: &str) -> Option<String> {
    let snake = || {
        let mut snake = String::with_capacity(variant.len() + 4);
        for (i, ch) in variant.char_indices() {
            if i > 0 && ch.is_uppercase() {
                snake.push('_');
            }
            snake.push(ch.to_ascii_lowercase());
        }
        snake
    };
    Some(match rule {
        "lowercase" => variant.to_ascii_lowercase(),
        "UPPERCASE" => variant.to_ascii_uppercase(),
        "PascalCase" => variant.to_owned(),
        "camelCase" => {
            let mut chars = variant.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_lowercase().to_string() + chars.as_str()
            })
        }
        "snake_case" => snake(),
        "SCREAMING_SNAKE_CASE" => snake().to_ascii_uppercase(),
        "kebab-case" => snake().replace('_', "-"),
        "SCREAMING-KEBAB-CASE" => snake().to_ascii_uppercase().replace('_', "-"),
        _ => return None,
    })
}

/// The input of `#[aggregate]`.
pub struct AggregateInput {
    /// The struct, with the `#[aggregate_id]` markers removed.
    pub item: ItemStruct,
    /// The type argument of the `PendingEvents<..>` field: the event type.
    pub event: Type,
    /// `name = ".."`, if given.
    pub name: Option<LitStr>,
    /// The id field.
    pub id: Member,
    /// The field of type `PendingEvents<..>` that holds the recorded events.
    pub pending: Member,
}

impl AggregateInput {
    /// Parses the attribute's arguments and the struct. On error, also returns the item to
    /// emit unchanged (minus the helper attributes), so one mistake does not cascade into
    /// "cannot find type" errors wherever the struct is used.
    pub fn parse(
        args: TokenStream,
        item: TokenStream,
        errors: &mut Errors,
    ) -> Result<Self, TokenStream> {
        let args = attr::aggregate_args(args, errors);
        let item: syn::Item = match syn::parse2(item.clone()) {
            Ok(item) => item,
            Err(error) => {
                errors.push(error);
                return Err(item);
            }
        };
        let mut item = match item {
            syn::Item::Struct(item) => item,
            other => {
                let token = match &other {
                    syn::Item::Enum(e) => e.enum_token.span(),
                    syn::Item::Union(u) => u.union_token.span(),
                    other => other.span(),
                };
                errors.push(syn::Error::new(
                    token,
                    "#[aggregate] goes on a struct with named fields",
                ));
                return Err(quote::quote!(#other));
            }
        };

        let mut ids = Vec::new();
        let mut buffers = Vec::new();
        let members: Vec<Member> = item.fields.members().collect();
        for (member, field) in members.into_iter().zip(item.fields.iter_mut()) {
            if let Some(event) = pending_events_argument(&field.ty) {
                buffers.push((member.clone(), field.ty.clone(), event));
            }
            let before = field.attrs.len();
            let mut marker = None;
            field.attrs.retain(|a| {
                let is_id = attr::is_aggregate_id(a, errors);
                if is_id {
                    marker = Some(a.path().clone());
                }
                !is_id
            });
            if field.attrs.len() < before {
                ids.push((member, marker.expect("removed an #[aggregate_id]")));
            }
        }

        if !matches!(item.fields, Fields::Named(_)) {
            let span = match &item.fields {
                Fields::Unnamed(fields) => fields.span(),
                _ => item.ident.span(),
            };
            errors.push(syn::Error::new(
                span,
                "#[aggregate] needs named fields: one holds the id, one the recorded events \
                 (`pending_events: PendingEvents<EventType>`)",
            ));
            return Err(quote::quote!(#item));
        }

        let id = match ids.as_slice() {
            [(member, _)] => Some(member.clone()),
            [_, (_, second), ..] => {
                errors.push(syn::Error::new_spanned(
                    second,
                    "#[aggregate_id] is set on two fields; keep it on the one field that holds \
                     the aggregate id",
                ));
                None
            }
            [] => {
                let named_id = item
                    .fields
                    .members()
                    .find(|m| matches!(m, Member::Named(ident) if ident.unraw() == "id"));
                if named_id.is_none() {
                    errors.push(syn::Error::new_spanned(
                        &item.ident,
                        format!(
                            "aggregate `{}` has no id field: mark the field that holds its id \
                             with #[aggregate_id], or name it `id`",
                            item.ident
                        ),
                    ));
                }
                named_id
            }
        };

        let pending = match buffers.as_slice() {
            [(member, _, event)] => Some((member.clone(), event.clone())),
            [_, (_, second, _), ..] => {
                errors.push(syn::Error::new_spanned(
                    second,
                    "a second `PendingEvents` field; an aggregate records its events in one \
                     field, keep one",
                ));
                None
            }
            [] => {
                errors.push(syn::Error::new_spanned(
                    &item.ident,
                    format!(
                        "aggregate `{}` has no field for the events it records: add \
                         `pending_events: PendingEvents<EventType>` (outbox_runtime::PendingEvents) \
                         with the event type it records, and set it to `PendingEvents::new()` \
                         where the struct is built",
                        item.ident
                    ),
                ));
                None
            }
        };

        match (id, pending) {
            (Some(id), Some((pending, event))) => Ok(Self {
                item,
                event,
                name: args.name,
                id,
                pending,
            }),
            _ => Err(quote::quote!(#item)),
        }
    }
}

/// `E` when `ty` is a path ending in `PendingEvents<E>` (`PendingEvents<E>`,
/// `outbox_runtime::PendingEvents<E>`, ...): the field that holds an aggregate's events.
fn pending_events_argument(ty: &Type) -> Option<Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "PendingEvents" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(arguments) = &last.arguments else {
        return None;
    };
    match arguments.args.first()? {
        syn::GenericArgument::Type(event) if arguments.args.len() == 1 => Some(event.clone()),
        _ => None,
    }
}

/// The input of `#[derive(EventSet)]`: an enum whose variants each hold one event type.
pub struct EventSet<'a> {
    pub input: &'a DeriveInput,
    /// Each variant and the event type it holds, in declaration order.
    pub members: Vec<(&'a Ident, &'a Type)>,
}

impl<'a> EventSet<'a> {
    /// The model, or `None` after reporting why it cannot be built: not an enum, or a
    /// variant that does not hold exactly one unnamed field.
    pub fn from_input(input: &'a DeriveInput, errors: &mut Errors) -> Option<Self> {
        const SHAPE: &str = "#[derive(EventSet)] goes on an enum whose variants each hold one \
                             DomainEvent type: `enum BankEvent { Account(AccountEvent), \
                             Transfer(TransferEvent) }`";
        let data = match &input.data {
            Data::Enum(data) => data,
            Data::Struct(data) => {
                errors.push(syn::Error::new(data.struct_token.span(), SHAPE));
                return None;
            }
            Data::Union(data) => {
                errors.push(syn::Error::new(data.union_token.span(), SHAPE));
                return None;
            }
        };
        let mut members = Vec::new();
        for variant in &data.variants {
            match &variant.fields {
                Fields::Unnamed(fields) if fields.unnamed.len() == 1 => {
                    members.push((&variant.ident, &fields.unnamed[0].ty));
                }
                _ => errors.push(syn::Error::new_spanned(
                    variant,
                    format!(
                        "variant `{0}` of an event set holds one DomainEvent type: \
                         `{0}({0}Event)`",
                        variant.ident
                    ),
                )),
            }
        }
        (members.len() == data.variants.len()).then_some(Self { input, members })
    }
}
