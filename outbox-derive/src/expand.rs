//! Code generation. Everything generated names the runtime by absolute path through
//! `::outbox_runtime::__private`, so it compiles whatever the user imported or renamed.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{DeriveInput, Fields, LitStr, Member};

use crate::ast::{AggregateInput, Event, EventKind, EventSet, EventType};
use crate::attr::{self, Errors, UpcastStep};
use crate::valid;

pub fn domain_event(input: &DeriveInput) -> syn::Result<TokenStream> {
    let mut errors = Errors::default();
    let event = Event::from_input(input, &mut errors);
    if let Some(event) = &event {
        valid::event(event, &mut errors);
    }
    errors.finish()?;
    let event = event.expect("no errors, so the model was built");
    Ok(expand_event(&event))
}

fn expand_event(event: &Event<'_>) -> TokenStream {
    let ident = &event.input.ident;
    let (impl_generics, ty_generics, where_clause) = event.input.generics.split_for_impl();
    let private = quote!(::outbox_runtime::__private);

    let types = event.event_types();
    let names: Vec<String> = types.iter().map(EventType::name).collect();
    let versions: Vec<i32> = types.iter().map(version).collect();

    let body = match &event.kind {
        EventKind::Struct(event_type) => {
            let name = &names[0];
            let version = versions[0];
            let partition_key = match event_type.partition_keys.first() {
                Some(key) => {
                    let member = &key.member;
                    let value = quote_spanned!(member.span()=> &self.#member);
                    quote!(#private::Option::Some(
                        #private::PartitionKeyValue::to_partition_key(#value)
                    ))
                }
                None => quote!(#private::Option::None),
            };
            let dedup_key = match event_type.dedup_keys.first() {
                Some(key) => {
                    let member = &key.member;
                    let value = quote_spanned!(member.span()=> &self.#member);
                    quote!(#private::DedupKeyValue::to_dedup_key(#value))
                }
                None => quote!(#private::Option::None),
            };
            // A unit struct has no data and needs no serde: its payload is `{}`.
            let (to_payload, decode) = if matches!(event_type.fields, Fields::Unit) {
                (
                    quote!(#private::Result::Ok(#private::String::from("{}"))),
                    quote!(#private::Result::Ok(Self)),
                )
            } else {
                (
                    quote!(#private::SerdeEvent::struct_to_payload(self, #name, #version)),
                    quote!(<Self as #private::SerdeEvent>::struct_from_payload(
                        event_type,
                        event_version,
                        payload,
                    )),
                )
            };
            let upcasts = upcast_arms(event_type, version, |_| decode.clone());
            quote! {
                fn event_type(&self) -> &'static str { #name }
                fn event_version(&self) -> i32 { #version }
                fn partition_key(&self) -> #private::Option<#private::String> { #partition_key }
                fn dedup_key(&self) -> #private::Option<#private::String> { #dedup_key }
                fn to_payload(&self) -> #private::Result<#private::String, #private::PayloadError> {
                    #to_payload
                }
                fn from_payload(
                    event_type: &str,
                    event_version: i32,
                    payload: &[u8],
                ) -> #private::Result<Self, #private::PayloadError> {
                    match (event_type, event_version) {
                        (#name, #version) => #decode,
                        #(#upcasts)*
                        _ => #private::Result::Err(
                            #private::PayloadError::unknown_event_type::<Self>(event_type, event_version),
                        ),
                    }
                }
            }
        }
        EventKind::Enum(variants) => {
            let encode = quote!(#private::SerdeEvent::variant_to_payload(
                self,
                #private::DomainEvent::event_type(self),
                #private::DomainEvent::event_version(self),
            ));
            let idents: Vec<_> = variants.iter().map(|v| v.ident).collect();
            let indices: Vec<u32> = variants.iter().map(|v| v.index).collect();
            let decode = |index: u32| {
                quote!(<Self as #private::SerdeEvent>::variant_from_payload(
                    #index,
                    event_type,
                    event_version,
                    payload,
                ))
            };
            let decodes = indices.iter().map(|index| decode(*index));
            let upcasts = variants
                .iter()
                .zip(&versions)
                .flat_map(|(variant, version)| upcast_arms(variant, *version, decode));
            let partition_keys = variants.iter().map(|v| match v.partition_keys.first() {
                Some(key) => {
                    let (ident, member) = (v.ident, &key.member);
                    let value = quote_spanned!(member.span()=> __partition_key);
                    quote! {
                        Self::#ident { #member: __partition_key, .. } =>
                            #private::Option::Some(
                                #private::PartitionKeyValue::to_partition_key(#value)
                            ),
                    }
                }
                None => {
                    let ident = v.ident;
                    quote!(Self::#ident { .. } => #private::Option::None,)
                }
            });
            let dedup_keys = variants.iter().map(|v| match v.dedup_keys.first() {
                Some(key) => {
                    let (ident, member) = (v.ident, &key.member);
                    let value = quote_spanned!(member.span()=> __dedup_key);
                    quote! {
                        Self::#ident { #member: __dedup_key, .. } =>
                            #private::DedupKeyValue::to_dedup_key(#value),
                    }
                }
                None => {
                    let ident = v.ident;
                    quote!(Self::#ident { .. } => #private::Option::None,)
                }
            });
            quote! {
                fn event_type(&self) -> &'static str {
                    match self { #(Self::#idents { .. } => #names,)* }
                }
                fn dedup_key(&self) -> #private::Option<#private::String> {
                    match self { #(#dedup_keys)* }
                }
                fn event_version(&self) -> i32 {
                    match self { #(Self::#idents { .. } => #versions,)* }
                }
                fn partition_key(&self) -> #private::Option<#private::String> {
                    match self { #(#partition_keys)* }
                }
                fn to_payload(&self) -> #private::Result<#private::String, #private::PayloadError> {
                    #encode
                }
                fn from_payload(
                    event_type: &str,
                    event_version: i32,
                    payload: &[u8],
                ) -> #private::Result<Self, #private::PayloadError> {
                    match (event_type, event_version) {
                        #((#names, #versions) => #decodes,)*
                        #(#upcasts)*
                        _ => #private::Result::Err(
                            #private::PayloadError::unknown_event_type::<Self>(event_type, event_version),
                        ),
                    }
                }
            }
        }
    };

    // The serde bound, stated once on the impl and spanned on the type, so a missing
    // derive is one error there (a unit struct has no payload to encode).
    let mut where_clause = where_clause
        .cloned()
        .unwrap_or_else(|| syn::parse_quote!(where));
    if !matches!(&event.kind, EventKind::Struct(t) if matches!(t.fields, Fields::Unit)) {
        where_clause
            .predicates
            .push(syn::parse_quote_spanned!(ident.span()=> Self: #private::SerdeEvent));
    }
    // A generic event is an event for the type arguments that make it one: `DomainEvent`'s
    // `Send + 'static`, stated on the impl as serde states its bounds, rather than an error
    // that `T` is not `Send`.
    if event.input.generics.type_params().next().is_some() {
        where_clause
            .predicates
            .push(syn::parse_quote_spanned!(ident.span()=> Self: #private::Send + 'static));
    }

    // Every type and version the decode reads: each current one, then the older versions its
    // upcasters read, oldest first.
    let private_ref = &private;
    let read_types = types
        .iter()
        .zip(&names)
        .zip(&versions)
        .flat_map(|((t, name), version)| {
            let private = private_ref;
            let older = sorted_upcasts(t).into_iter().map(|(from, _)| from);
            std::iter::once(*version)
                .chain(older)
                .map(move |version| quote!(#private::EventType { name: #name, version: #version }))
        });
    quote! {
        #[automatically_derived]
        impl #impl_generics #private::DomainEvent for #ident #ty_generics #where_clause {
            const EVENT_TYPES: &'static [#private::EventType] = &[#(#read_types,)*];
            #body
        }
    }
}

/// The upcasts of an event type, checked already, ordered by the version they read.
fn sorted_upcasts<'e>(event_type: &'e EventType<'_>) -> Vec<(i32, &'e UpcastStep)> {
    let mut steps: Vec<(i32, &UpcastStep)> = event_type
        .upcasts
        .iter()
        .filter_map(|u| Some((u.from.as_ref()?.base10_parse().ok()?, u.step.as_ref()?)))
        .collect();
    steps.sort_by_key(|(from, _)| *from);
    steps
}

/// One match arm per older version of `event_type` (at `version`): the payload is read as
/// that version's type or JSON, then taken through every upcast up to `version`, where it
/// becomes `Self` by a `From` conversion or by `decode` (the current version's own decode,
/// given the index of the variant, reading `payload` at `event_version`).
fn upcast_arms(
    event_type: &EventType<'_>,
    version: i32,
    decode: impl Fn(u32) -> TokenStream,
) -> Vec<TokenStream> {
    let private = quote!(::outbox_runtime::__private);
    let name = event_type.name();
    let steps = sorted_upcasts(event_type);
    let decode = decode(event_type.index);
    // The type version `from + 1` is read as: the next upcast's type, or Self at `version`.
    let next_type = |i: usize| -> Option<TokenStream> {
        match steps.get(i + 1) {
            Some((_, UpcastStep::Type(ty))) => Some(quote!(#ty)),
            Some((_, UpcastStep::Json(_))) => None,
            None => Some(quote!(Self)),
        }
    };
    (0..steps.len())
        .map(|start| {
            let (first, first_step) = steps[start];
            let mut body = match first_step {
                UpcastStep::Type(ty) => quote_spanned! {ty.span()=>
                    let value = #private::read_old::<#ty, Self>(event_type, #first, payload)?;
                },
                UpcastStep::Json(_) => quote! {
                    let value = #private::read_json::<Self>(event_type, #first, payload)?;
                },
            };
            for (i, (from, step)) in steps.iter().enumerate().skip(start) {
                let next = from + 1;
                let last = next == version;
                match step {
                    UpcastStep::Type(ty) => {
                        let into = next_type(i).expect("checked: a typed upcast leads to a type");
                        // Spanned on the old type, `Self` included: a missing `From` is an
                        // error there.
                        let into = respan(into, ty.span());
                        body.extend(quote_spanned! {ty.span()=>
                            let value = #private::upcast_into::<#ty, #into>(value);
                        });
                    }
                    UpcastStep::Json(function) => {
                        body.extend(quote_spanned! {function.span()=>
                            let value = #private::upcast_json::<Self, _>(
                                #function, value, event_type, #from,
                            )?;
                        });
                        if last {
                            body.extend(quote! {
                                let bytes = #private::json_bytes(&value);
                                let payload: &[u8] = &bytes;
                                let event_version: i32 = #version;
                                // A unit struct's decode reads neither.
                                let _ = (payload, event_version);
                            });
                        } else if let Some(ty) = next_type(i) {
                            body.extend(quote! {
                                let value = #private::from_json_value::<#ty, Self>(
                                    value, event_type, #next,
                                )?;
                            });
                        }
                    }
                }
            }
            let result = match steps.last() {
                Some((_, UpcastStep::Type(_))) => quote!(#private::Result::Ok(value)),
                _ => decode.clone(),
            };
            quote! {
                (#name, #first) => {
                    #body
                    #result
                }
            }
        })
        .collect()
}

/// `tokens`, every token spanned at `span`.
fn respan(tokens: TokenStream, span: proc_macro2::Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut token| {
            if let proc_macro2::TokenTree::Group(group) = &token {
                let mut inner =
                    proc_macro2::Group::new(group.delimiter(), respan(group.stream(), span));
                inner.set_span(span);
                token = inner.into();
            }
            token.set_span(span);
            token
        })
        .collect()
}

fn version(event_type: &EventType<'_>) -> i32 {
    event_type
        .version
        .as_ref()
        .and_then(|v| v.base10_parse().ok())
        .unwrap_or(1)
}

pub fn aggregate(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut errors = Errors::default();
    let input = match AggregateInput::parse(args, item, &mut errors) {
        Ok(input) => input,
        Err(item) => return with_errors(item, errors),
    };
    valid::aggregate(&input, &mut errors);
    match errors.finish() {
        Ok(()) => expand_aggregate(input),
        Err(error) => {
            let item = &input.item;
            let errors = error.into_compile_error();
            quote!(#item #errors)
        }
    }
}

fn with_errors(item: TokenStream, errors: Errors) -> TokenStream {
    let errors = errors.finish().err().map(syn::Error::into_compile_error);
    quote!(#item #errors)
}

fn expand_aggregate(input: AggregateInput) -> TokenStream {
    let AggregateInput {
        mut item,
        event,
        name,
        id,
        pending,
    } = input;
    let private = quote!(::outbox_runtime::__private);
    let ident = &item.ident;
    let vis = &item.vis;
    // A raw identifier names the aggregate without its `r#`, as serde names it.
    let name = name.unwrap_or_else(|| LitStr::new(&ident.unraw().to_string(), ident.span()));

    // Other derives on the struct must leave the buffer alone: it is no state of the
    // aggregate, and has no column.
    let derives: Vec<String> = attr::derives(&item.attrs)
        .iter()
        .map(attr::last_segment)
        .collect();
    let derived = |name: &str| derives.iter().any(|d| d == name);
    let mut skips: Vec<syn::Attribute> = Vec::new();
    if derived("Serialize") || derived("Deserialize") {
        skips.push(syn::parse_quote!(#[serde(skip)]));
    }
    if derived("Insertable") {
        skips.push(syn::parse_quote!(#[diesel(skip_insertion)]));
    }
    if derived("AsChangeset") {
        skips.push(syn::parse_quote!(#[diesel(skip_update)]));
    }
    let members: Vec<Member> = item.fields.members().collect();
    if let Some(field) = members
        .iter()
        .zip(item.fields.iter_mut())
        .find_map(|(member, field)| (*member == pending).then_some(field))
    {
        for skip in skips {
            // A field that already says how serde or diesel treat it keeps its own word.
            let tool = skip.path().get_ident().cloned();
            if !field
                .attrs
                .iter()
                .any(|a| tool.as_ref().is_some_and(|t| a.path().is_ident(t)))
            {
                field.attrs.push(skip);
            }
        }
    }
    let buffer = &pending;

    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    let id_value = quote_spanned!(id.span()=> &self.#id);
    quote! {
        #item

        #[automatically_derived]
        impl #impl_generics #private::Aggregate for #ident #ty_generics #where_clause {
            type Event = #event;
            const AGGREGATE_TYPE: &'static str = #name;
            fn aggregate_id(&self) -> #private::String {
                #private::AggregateIdValue::to_aggregate_id(#id_value)
            }
            fn pending(&self) -> &#private::PendingEvents<#event> {
                &self.#buffer
            }
            fn pending_mut(&mut self) -> &mut #private::PendingEvents<#event> {
                &mut self.#buffer
            }
        }

        impl #impl_generics #ident #ty_generics #where_clause {
            /// Records `event`: a unit of work that tracks this aggregate writes it to the
            /// outbox, and it is published once that unit of work commits.
            #vis fn record(&mut self, event: #event) {
                #private::Aggregate::record(self, event)
            }

            /// The events recorded and not yet committed, oldest first.
            #vis fn pending_events(&self) -> &[#event] {
                #private::Aggregate::pending_events(self)
            }

            /// Drops the events recorded and not yet committed, on purpose, and returns
            /// them (dropping an aggregate that holds some logs a warning in debug builds).
            #vis fn discard_pending_events(&mut self) -> #private::Vec<#event> {
                #private::Aggregate::discard_pending_events(self)
            }
        }
    }
}

pub fn event_set(input: &DeriveInput) -> syn::Result<TokenStream> {
    let mut errors = Errors::default();
    let set = EventSet::from_input(input, &mut errors);
    if let Some(set) = &set {
        valid::event_set(set, &mut errors);
    }
    errors.finish()?;
    Ok(expand_event_set(
        &set.expect("no errors, so the model was built"),
    ))
}

fn expand_event_set(set: &EventSet<'_>) -> TokenStream {
    let private = quote!(::outbox_runtime::__private);
    let ident = &set.input.ident;
    // Each member's type, spanned on the variant's type: a type that is no DomainEvent is
    // one error there.
    let types: Vec<TokenStream> = set
        .members
        .iter()
        .map(|(_, ty)| quote_spanned!(ty.span()=> <#ty as #private::DomainEvent>))
        .collect();
    let variants: Vec<_> = set.members.iter().map(|(variant, _)| *variant).collect();
    // Two members that carry the same event type and version: a compile error on the later
    // one, naming both (the inbox decodes by type and version alone).
    let mut disjoint = Vec::new();
    for (later, (variant, ty)) in set.members.iter().enumerate() {
        for (earlier, _) in set.members[..later].iter().enumerate() {
            let (first, second) = (&types[earlier], &types[later]);
            let message = format!(
                "variants `{}` and `{variant}` of `{ident}` carry the same event type at the \
                 same version: a consumer decodes by ce-type and ce-eventversion and could not \
                 tell them apart; give one an #[event(name = \"..\")] of its own",
                variants[earlier],
            );
            disjoint.push(quote_spanned! {ty.span()=>
                const _: () = if #private::overlap(#first::EVENT_TYPES, #second::EVENT_TYPES) {
                    panic!(#message)
                };
            });
        }
    }
    quote! {
        #[automatically_derived]
        impl #private::EventSet for #ident {
            const MEMBERS: &'static [&'static [#private::EventType]] = &[
                #(#types::EVENT_TYPES,)*
            ];

            fn decode(
                event_type: &str,
                event_version: i32,
                payload: &[u8],
            ) -> #private::Result<Self, #private::PayloadError> {
                #(
                    if #types::EVENT_TYPES
                        .iter()
                        .any(|t| t.name == event_type && t.version == event_version)
                    {
                        return #types::from_payload(event_type, event_version, payload)
                            .map(Self::#variants);
                    }
                )*
                #private::Result::Err(
                    #private::PayloadError::unknown_event_type::<Self>(event_type, event_version),
                )
            }
        }

        #(#disjoint)*
    }
}
