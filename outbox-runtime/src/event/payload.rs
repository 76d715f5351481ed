//! Payload encoding for `#[derive(DomainEvent)]`, through the user's own serde derives.
//!
//! A struct event's payload is `serde_json` of the struct. An enum's payload is the content
//! of its variant: [`VariantContent`] is a serializer that receives serde's call for the
//! variant (`serialize_struct_variant`, `serialize_newtype_variant`, ...) and writes only the
//! content, and [`VariantDeserializer`] presents a payload to the enum's `Deserialize` as the
//! variant with a given index. Field attributes (`rename`, `with`, `default`, `flatten`, ...)
//! keep working because serde's own generated code still does all the field work.
//!
//! The variant is named by its index in declaration order, which serde's derived variant
//! identifiers accept (`visit_u64`); the derive rejects `#[serde(skip)]` and `#[serde(other)]`
//! on event variants, so the indices of the two derives agree.

use serde::de::{
    self, Deserialize as _, DeserializeOwned, DeserializeSeed, IntoDeserializer, Visitor,
};
use serde::ser::{self, Impossible, Serialize, SerializeStruct, Serializer};

use super::PayloadError;
use super::storable::{may_hold_unstorable, unstorable};

/// How `#[derive(DomainEvent)]` encodes and decodes payloads: through the type's own serde
/// derives. Implemented for every `Serialize + DeserializeOwned` type; a trait of its own so
/// that a missing derive is one error, in words about events.
#[diagnostic::on_unimplemented(
    message = "`{Self}` derives DomainEvent but not serde's Serialize and Deserialize",
    label = "the payload of this event is its JSON, written and read by serde",
    note = "add #[derive(serde::Serialize, serde::Deserialize)] beside #[derive(DomainEvent)]"
)]
pub trait SerdeEvent: Sized {
    /// Payload of a struct event: its JSON. `event_type` and `event_version` name it in
    /// errors.
    fn struct_to_payload(
        &self,
        event_type: &str,
        event_version: i32,
    ) -> Result<String, PayloadError>;

    /// Decodes a struct event's payload (the caller has matched the type and version).
    fn struct_from_payload(
        event_type: &str,
        event_version: i32,
        payload: &[u8],
    ) -> Result<Self, PayloadError>;

    /// Payload of an enum event: the JSON of its variant's content.
    fn variant_to_payload(
        &self,
        event_type: &str,
        event_version: i32,
    ) -> Result<String, PayloadError>;

    /// Decodes an enum event's payload as the variant at `variant_index` (declaration
    /// order).
    fn variant_from_payload(
        variant_index: u32,
        event_type: &str,
        event_version: i32,
        payload: &[u8],
    ) -> Result<Self, PayloadError>;
}

impl<T: Serialize + DeserializeOwned> SerdeEvent for T {
    fn struct_to_payload(
        &self,
        event_type: &str,
        event_version: i32,
    ) -> Result<String, PayloadError> {
        let json = serde_json::to_string(self)
            .map_err(|e| PayloadError::json::<T>(event_type, event_version, e))?;
        refuse_unstorable(self, json, event_type, event_version)
    }

    fn struct_from_payload(
        event_type: &str,
        event_version: i32,
        payload: &[u8],
    ) -> Result<Self, PayloadError> {
        serde_json::from_slice(payload)
            .map_err(|e| PayloadError::json::<T>(event_type, event_version, e))
    }

    fn variant_to_payload(
        &self,
        event_type: &str,
        event_version: i32,
    ) -> Result<String, PayloadError> {
        let error = |e| PayloadError::json::<T>(event_type, event_version, e);
        let mut json = Vec::with_capacity(128);
        self.serialize(VariantContent(&mut serde_json::Serializer::new(&mut json)))
            .map_err(error)?;
        // serde_json writes UTF-8 only; the check is a cheap guard, not an expected path.
        let json = String::from_utf8(json).map_err(|e| error(ser::Error::custom(e)))?;
        refuse_unstorable(self, json, event_type, event_version)
    }

    fn variant_from_payload(
        variant_index: u32,
        event_type: &str,
        event_version: i32,
        payload: &[u8],
    ) -> Result<Self, PayloadError> {
        let decode = || {
            let mut json = serde_json::Deserializer::from_slice(payload);
            let value = T::deserialize(VariantDeserializer {
                index: variant_index,
                content: &mut json,
            })?;
            json.end()?;
            Ok(value)
        };
        decode().map_err(|e| PayloadError::json::<T>(event_type, event_version, e))
    }
}

/// `json`, unless `value` holds a number or string that JSON or `jsonb` cannot carry (see
/// [`super::storable`]): then an error that names it by its path.
fn refuse_unstorable<T: Serialize>(
    value: &T,
    json: String,
    event_type: &str,
    event_version: i32,
) -> Result<String, PayloadError> {
    if may_hold_unstorable(&json)
        && let Some(what) = unstorable(value)
    {
        return Err(PayloadError::json::<T>(
            event_type,
            event_version,
            ser::Error::custom(what),
        ));
    }
    Ok(json)
}

const NOT_A_VARIANT: &str = "a DomainEvent enum must serialize as one of its variants \
     (serde's default, externally tagged representation)";

/// Serializes the content of an enum variant, dropping serde's variant tag.
struct VariantContent<S>(S);

impl<S: Serializer> VariantContent<S> {
    fn not_a_variant(self) -> Result<S::Ok, S::Error> {
        Err(ser::Error::custom(NOT_A_VARIANT))
    }
}

impl<S: Serializer> Serializer for VariantContent<S> {
    type Ok = S::Ok;
    type Error = S::Error;
    type SerializeSeq = Impossible<S::Ok, S::Error>;
    type SerializeTuple = Impossible<S::Ok, S::Error>;
    type SerializeTupleStruct = Impossible<S::Ok, S::Error>;
    type SerializeTupleVariant = Impossible<S::Ok, S::Error>;
    type SerializeMap = Impossible<S::Ok, S::Error>;
    type SerializeStruct = Impossible<S::Ok, S::Error>;
    type SerializeStructVariant = StructContent<S::SerializeStruct>;

    /// A unit variant carries no data; its payload is an empty object, so consumers in any
    /// language can read every payload as an object.
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
    ) -> Result<S::Ok, S::Error> {
        self.0.serialize_struct("", 0)?.end()
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        value: &T,
    ) -> Result<S::Ok, S::Error> {
        value.serialize(self.0)
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeStructVariant, S::Error> {
        self.0.serialize_struct(variant, len).map(StructContent)
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleVariant, S::Error> {
        Err(ser::Error::custom(
            "a DomainEvent variant has named fields, one unnamed field, or none",
        ))
    }

    fn serialize_bool(self, _: bool) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_i8(self, _: i8) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_i16(self, _: i16) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_i32(self, _: i32) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_i64(self, _: i64) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_u8(self, _: u8) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_u16(self, _: u16) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_u32(self, _: u32) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_u64(self, _: u64) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_f32(self, _: f32) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_f64(self, _: f64) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_char(self, _: char) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_str(self, _: &str) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_none(self) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_unit(self) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: &T,
    ) -> Result<S::Ok, S::Error> {
        self.not_a_variant()
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, S::Error> {
        Err(ser::Error::custom(NOT_A_VARIANT))
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, S::Error> {
        Err(ser::Error::custom(NOT_A_VARIANT))
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, S::Error> {
        Err(ser::Error::custom(NOT_A_VARIANT))
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, S::Error> {
        Err(ser::Error::custom(NOT_A_VARIANT))
    }
    fn serialize_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStruct, S::Error> {
        Err(ser::Error::custom(NOT_A_VARIANT))
    }
}

/// The fields of a struct variant, written as a plain struct (a JSON object).
struct StructContent<S>(S);

impl<S: SerializeStruct> ser::SerializeStructVariant for StructContent<S> {
    type Ok = S::Ok;
    type Error = S::Error;

    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), S::Error> {
        self.0.serialize_field(key, value)
    }

    fn skip_field(&mut self, key: &'static str) -> Result<(), S::Error> {
        self.0.skip_field(key)
    }

    fn end(self) -> Result<S::Ok, S::Error> {
        self.0.end()
    }
}

/// Presents a payload to an enum's `Deserialize` as the variant at `index`.
struct VariantDeserializer<D> {
    index: u32,
    content: D,
}

impl<'de, D: de::Deserializer<'de>> de::Deserializer<'de> for VariantDeserializer<D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, D::Error> {
        Err(de::Error::custom(NOT_A_VARIANT))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        visitor.visit_enum(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map struct identifier ignored_any
    }
}

impl<'de, D: de::Deserializer<'de>> de::EnumAccess<'de> for VariantDeserializer<D> {
    type Error = D::Error;
    type Variant = Self;

    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Self), D::Error> {
        let variant = seed.deserialize(self.index.into_deserializer())?;
        Ok((variant, self))
    }
}

impl<'de, D: de::Deserializer<'de>> de::VariantAccess<'de> for VariantDeserializer<D> {
    type Error = D::Error;

    /// Accepts `{}` (what [`VariantContent`] writes) and `null` alike.
    fn unit_variant(self) -> Result<(), D::Error> {
        de::IgnoredAny::deserialize(self.content).map(drop)
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, D::Error> {
        seed.deserialize(self.content)
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, D::Error> {
        self.content.deserialize_tuple(len, visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.content.deserialize_struct("", fields, visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{DomainEvent, EventType};
    use serde::{Deserialize, Serialize};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Line {
        sku: String,
        qty: u32,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum OrderEvent {
        Placed {
            #[serde(rename = "orderId")]
            order_id: String,
            lines: Vec<Line>,
            #[serde(default, skip_serializing_if = "Option::is_none")]
            note: Option<String>,
        },
        Relabelled(Line),
        Cancelled,
    }

    // A hand-written implementation, as the derive would generate it.
    impl DomainEvent for OrderEvent {
        const EVENT_TYPES: &'static [EventType] = &[
            EventType {
                name: "Placed",
                version: 1,
            },
            EventType {
                name: "Relabelled",
                version: 1,
            },
            EventType {
                name: "Cancelled",
                version: 1,
            },
        ];
        fn event_type(&self) -> &'static str {
            match self {
                Self::Placed { .. } => "Placed",
                Self::Relabelled(_) => "Relabelled",
                Self::Cancelled => "Cancelled",
            }
        }
        fn event_version(&self) -> i32 {
            1
        }
        fn partition_key(&self) -> Option<String> {
            None
        }
        fn to_payload(&self) -> Result<String, PayloadError> {
            SerdeEvent::variant_to_payload(self, self.event_type(), 1)
        }
        fn from_payload(t: &str, v: i32, payload: &[u8]) -> Result<Self, PayloadError> {
            let index = match (t, v) {
                ("Placed", 1) => 0,
                ("Relabelled", 1) => 1,
                ("Cancelled", 1) => 2,
                _ => return Err(PayloadError::unknown_event_type::<Self>(t, v)),
            };
            <Self as SerdeEvent>::variant_from_payload(index, t, v, payload)
        }
    }

    fn round_trip(event: OrderEvent, expected_json: &str) {
        let json = event.to_payload().unwrap();
        assert_eq!(json, expected_json);
        let back = OrderEvent::from_payload(event.event_type(), 1, json.as_bytes()).unwrap();
        assert_eq!(back, event);
    }

    #[test]
    fn struct_variant_payload_is_its_fields_with_serde_attributes() {
        round_trip(
            OrderEvent::Placed {
                order_id: "o-1".into(),
                lines: vec![Line {
                    sku: "a".into(),
                    qty: 2,
                }],
                note: None,
            },
            r#"{"orderId":"o-1","lines":[{"sku":"a","qty":2}]}"#,
        );
    }

    #[test]
    fn newtype_variant_payload_is_the_inner_value() {
        round_trip(
            OrderEvent::Relabelled(Line {
                sku: "b".into(),
                qty: 1,
            }),
            r#"{"sku":"b","qty":1}"#,
        );
    }

    #[test]
    fn unit_variant_payload_is_an_empty_object() {
        round_trip(OrderEvent::Cancelled, "{}");
        let from_null = OrderEvent::from_payload("Cancelled", 1, b"null").unwrap();
        assert_eq!(from_null, OrderEvent::Cancelled);
    }

    #[test]
    fn decode_errors_name_the_type_and_the_problem() {
        let err = OrderEvent::from_payload("Shipped", 3, b"{}").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{} has no event type \"Shipped\" at version 3 \
                 (it carries Placed v1, Relabelled v1, Cancelled v1)",
                std::any::type_name::<OrderEvent>()
            )
        );
        let err = OrderEvent::from_payload("Placed", 1, br#"{"orderId":1}"#).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("\"Placed\" v1"), "{text}");
        assert!(text.contains("invalid type: integer `1`"), "{text}");
        let err =
            OrderEvent::from_payload("Placed", 1, br#"{"orderId":"x","lines":[]} x"#).unwrap_err();
        assert!(err.to_string().contains("trailing characters"), "{err}");
    }

    #[test]
    fn a_non_enum_value_is_refused_by_the_variant_serializer() {
        struct NotAnEnum;
        impl Serialize for NotAnEnum {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str("x")
            }
        }
        let mut out = Vec::new();
        let err = NotAnEnum
            .serialize(VariantContent(&mut serde_json::Serializer::new(&mut out)))
            .unwrap_err();
        assert!(err.to_string().contains("externally tagged"), "{err}");
    }
}
