//! `#[derive(DomainEvent)]` and `#[aggregate]`, the macros of the outbox toolkit.
//!
//! Use them through `outbox_runtime`, which re-exports both and holds the traits they
//! implement. Each macro runs the same phases, one file each: `attr` parses the
//! attributes, `ast` builds the typed model, `valid` checks it (every error on the exact
//! token that is wrong), `expand` generates the code.

mod ast;
mod attr;
mod expand;
mod valid;

use proc_macro::TokenStream;

/// Implements `outbox_runtime::DomainEvent` for a struct (one event type) or an enum (one
/// event type per variant). The reference of its attributes, with examples, is on its
/// re-export, `outbox_runtime::DomainEvent` (the derive).
#[proc_macro_derive(DomainEvent, attributes(event))]
pub fn derive_domain_event(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::domain_event(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// Implements `outbox_runtime::EventSet` for an enum whose variants each hold one
/// `DomainEvent` type: the events one consumer takes. Documented on its re-export,
/// `outbox_runtime::EventSet` (the trait).
#[proc_macro_derive(EventSet)]
pub fn derive_event_set(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::event_set(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// Turns a struct into an `outbox_runtime::Aggregate` that records events of the type named
/// by `event = ...`. The reference of its arguments, with an example, is on its re-export,
/// `outbox_runtime::aggregate` (the attribute).
#[proc_macro_attribute]
pub fn aggregate(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::aggregate(args.into(), item.into()).into()
}
