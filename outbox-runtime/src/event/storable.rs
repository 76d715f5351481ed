//! What JSON, or PostgreSQL's `jsonb`, cannot carry, found before it is lost.
//!
//! serde_json writes a NaN or infinite float as `null` without an error (JSON has no such
//! numbers: RFC 8259, section 6), so an event would be published with a value its producer
//! never had. And `jsonb` refuses the escape `\u0000` (PostgreSQL docs, section 8.14, "JSON
//! Types"), so a string holding NUL fails the commit with "unsupported Unicode escape
//! sequence" and no word of which field. [`unstorable`] walks the value through its own
//! `Serialize` and names the first such value by its path (`$.lines[2].price`). It runs only
//! when the serialized JSON shows a trace of one (`null`, or `\u0000`), so a payload without
//! either costs nothing more.

use std::cell::RefCell;
use std::fmt;

use serde::ser::{self, Impossible, Serialize};

/// The first value of `value` that JSON or `jsonb` cannot carry, described with its path;
/// `None` when there is none (or when the value does not serialize, which the caller reports
/// on its own).
pub(crate) fn unstorable<T: Serialize + ?Sized>(value: &T) -> Option<String> {
    let path = RefCell::new(Vec::new());
    match value.serialize(Check { path: &path }) {
        Err(Found::Unstorable(what)) => Some(what),
        Err(Found::Other(_)) | Ok(()) => None,
    }
}

/// Whether a serialized payload may hold an unstorable value: NaN and infinity become
/// `null`, NUL becomes `\u0000`.
pub(crate) fn may_hold_unstorable(json: &str) -> bool {
    json.contains("null") || json.contains("\\u0000")
}

#[derive(Debug)]
enum Found {
    Unstorable(String),
    Other(String),
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unstorable(what) | Self::Other(what) => f.write_str(what),
        }
    }
}

impl std::error::Error for Found {}

impl ser::Error for Found {
    fn custom<T: fmt::Display>(message: T) -> Self {
        Self::Other(message.to_string())
    }
}

/// A serializer that writes nothing and fails at the first unstorable value.
#[derive(Clone, Copy)]
struct Check<'p> {
    path: &'p RefCell<Vec<String>>,
}

impl Check<'_> {
    fn at(&self) -> String {
        let mut text = String::from("$");
        for segment in self.path.borrow().iter() {
            text.push_str(segment);
        }
        text
    }

    fn float(self, value: f64) -> Result<(), Found> {
        if value.is_finite() {
            return Ok(());
        }
        Err(Found::Unstorable(format!(
            "the number at {} is {value}, which JSON cannot carry (serde_json would write null)",
            self.at()
        )))
    }

    fn string(self, value: &str, what: &str) -> Result<(), Found> {
        if !value.contains('\0') {
            return Ok(());
        }
        Err(Found::Unstorable(format!(
            "the {what} at {} contains a NUL character (U+0000), which PostgreSQL's jsonb \
             cannot store",
            self.at()
        )))
    }

    fn nested<T: Serialize + ?Sized>(self, segment: String, value: &T) -> Result<(), Found> {
        self.path.borrow_mut().push(segment);
        let result = value.serialize(self);
        self.path.borrow_mut().pop();
        result
    }
}

/// The path segment of a field or a map key: `.name`, or `["name with spaces"]`.
fn key_segment(key: &str) -> String {
    if !key.is_empty() && key.chars().all(|c| c.is_alphanumeric() || c == '_') {
        format!(".{key}")
    } else {
        format!("[{key:?}]")
    }
}

impl<'p> ser::Serializer for Check<'p> {
    type Ok = ();
    type Error = Found;
    type SerializeSeq = Elements<'p>;
    type SerializeTuple = Elements<'p>;
    type SerializeTupleStruct = Elements<'p>;
    type SerializeTupleVariant = Elements<'p>;
    type SerializeMap = Entries<'p>;
    type SerializeStruct = Fields<'p>;
    type SerializeStructVariant = Fields<'p>;

    fn serialize_bool(self, _: bool) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i8(self, _: i8) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i16(self, _: i16) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i32(self, _: i32) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i64(self, _: i64) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_i128(self, _: i128) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u8(self, _: u8) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u16(self, _: u16) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u32(self, _: u32) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u64(self, _: u64) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_u128(self, _: u128) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_f32(self, value: f32) -> Result<(), Found> {
        self.float(f64::from(value))
    }
    fn serialize_f64(self, value: f64) -> Result<(), Found> {
        self.float(value)
    }
    fn serialize_char(self, value: char) -> Result<(), Found> {
        self.string(value.encode_utf8(&mut [0; 4]), "character")
    }
    fn serialize_str(self, value: &str) -> Result<(), Found> {
        self.string(value, "string")
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_none(self) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Found> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> Result<(), Found> {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Found> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        value: &T,
    ) -> Result<(), Found> {
        value.serialize(self)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Elements<'p>, Found> {
        Ok(Elements {
            check: self,
            index: 0,
        })
    }
    fn serialize_tuple(self, _: usize) -> Result<Elements<'p>, Found> {
        Ok(Elements {
            check: self,
            index: 0,
        })
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Elements<'p>, Found> {
        Ok(Elements {
            check: self,
            index: 0,
        })
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Elements<'p>, Found> {
        Ok(Elements {
            check: self,
            index: 0,
        })
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Entries<'p>, Found> {
        Ok(Entries {
            check: self,
            key: String::new(),
        })
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Fields<'p>, Found> {
        Ok(Fields { check: self })
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Fields<'p>, Found> {
        Ok(Fields { check: self })
    }
}

/// The elements of a sequence or tuple, by index.
struct Elements<'p> {
    check: Check<'p>,
    index: usize,
}

impl Elements<'_> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Found> {
        let segment = format!("[{}]", self.index);
        self.index += 1;
        self.check.nested(segment, value)
    }
}

macro_rules! elements {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for Elements<'_> {
            type Ok = ();
            type Error = Found;
            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Found> {
                self.element(value)
            }
            fn end(self) -> Result<(), Found> {
                Ok(())
            }
        }
    )*};
}

elements!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

/// The fields of a struct, by name.
struct Fields<'p> {
    check: Check<'p>,
}

impl ser::SerializeStruct for Fields<'_> {
    type Ok = ();
    type Error = Found;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Found> {
        self.check.nested(key_segment(key), value)
    }
    fn end(self) -> Result<(), Found> {
        Ok(())
    }
}

impl ser::SerializeStructVariant for Fields<'_> {
    type Ok = ();
    type Error = Found;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Found> {
        self.check.nested(key_segment(key), value)
    }
    fn end(self) -> Result<(), Found> {
        Ok(())
    }
}

/// The entries of a map, by key.
struct Entries<'p> {
    check: Check<'p>,
    key: String,
}

impl ser::SerializeMap for Entries<'_> {
    type Ok = ();
    type Error = Found;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Found> {
        // JSON keys are strings: serde_json writes a string, a number or a bool as one.
        self.key = key.serialize(KeyText).unwrap_or_default();
        if self.key.contains('\0') {
            return Err(Found::Unstorable(format!(
                "a map key at {} contains a NUL character (U+0000), which PostgreSQL's jsonb \
                 cannot store",
                self.check.at()
            )));
        }
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Found> {
        self.check.nested(key_segment(&self.key), value)
    }
    fn end(self) -> Result<(), Found> {
        Ok(())
    }
}

/// A map key as text, for the path.
struct KeyText;

impl ser::Serializer for KeyText {
    type Ok = String;
    type Error = Found;
    type SerializeSeq = Impossible<String, Found>;
    type SerializeTuple = Impossible<String, Found>;
    type SerializeTupleStruct = Impossible<String, Found>;
    type SerializeTupleVariant = Impossible<String, Found>;
    type SerializeMap = Impossible<String, Found>;
    type SerializeStruct = Impossible<String, Found>;
    type SerializeStructVariant = Impossible<String, Found>;

    fn serialize_str(self, value: &str) -> Result<String, Found> {
        Ok(value.to_owned())
    }
    fn serialize_char(self, value: char) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_bool(self, value: bool) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_i8(self, value: i8) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_i16(self, value: i16) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_i32(self, value: i32) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_i64(self, value: i64) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_u8(self, value: u8) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_u16(self, value: u16) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_u32(self, value: u32) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_u64(self, value: u64) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_f32(self, value: f32) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_f64(self, value: f64) -> Result<String, Found> {
        Ok(value.to_string())
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<String, Found> {
        Err(ser::Error::custom("bytes key"))
    }
    fn serialize_none(self) -> Result<String, Found> {
        Err(ser::Error::custom("none key"))
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<String, Found> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<String, Found> {
        Err(ser::Error::custom("unit key"))
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<String, Found> {
        Err(ser::Error::custom("unit key"))
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<String, Found> {
        Ok(variant.to_owned())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<String, Found> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<String, Found> {
        Err(ser::Error::custom("variant key"))
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Found> {
        Err(ser::Error::custom("sequence key"))
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Found> {
        Err(ser::Error::custom("tuple key"))
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Found> {
        Err(ser::Error::custom("tuple key"))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Found> {
        Err(ser::Error::custom("tuple key"))
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, Found> {
        Err(ser::Error::custom("map key"))
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, Found> {
        Err(ser::Error::custom("struct key"))
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Found> {
        Err(ser::Error::custom("struct key"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[derive(serde::Serialize)]
    struct Line {
        sku: String,
        price: f64,
    }

    #[derive(serde::Serialize)]
    struct Order {
        customer: String,
        lines: Vec<Line>,
        tags: BTreeMap<String, String>,
        ratio: Option<f32>,
    }

    fn order() -> Order {
        Order {
            customer: "ada".into(),
            lines: vec![
                Line {
                    sku: "tea".into(),
                    price: 4.5,
                },
                Line {
                    sku: "cake".into(),
                    price: 2.0,
                },
            ],
            tags: BTreeMap::from([("gift wrap".to_owned(), "yes".to_owned())]),
            ratio: None,
        }
    }

    #[test]
    fn finite_numbers_and_plain_strings_are_storable() {
        assert_eq!(unstorable(&order()), None);
    }

    #[test]
    fn nan_and_infinity_are_found_by_their_path() {
        let mut nan = order();
        nan.lines[1].price = f64::NAN;
        assert_eq!(
            unstorable(&nan).unwrap(),
            "the number at $.lines[1].price is NaN, which JSON cannot carry (serde_json would \
             write null)"
        );
        let mut infinite = order();
        infinite.ratio = Some(f32::INFINITY);
        assert!(
            unstorable(&infinite)
                .unwrap()
                .starts_with("the number at $.ratio is inf")
        );
    }

    #[test]
    fn nul_characters_are_found_in_values_and_keys() {
        let mut nul = order();
        nul.tags.insert("gift wrap".into(), "a\0b".into());
        assert_eq!(
            unstorable(&nul).unwrap(),
            "the string at $.tags[\"gift wrap\"] contains a NUL character (U+0000), which \
             PostgreSQL's jsonb cannot store"
        );
        let mut key = order();
        key.tags.insert("k\0".into(), "v".into());
        assert!(
            unstorable(&key)
                .unwrap()
                .starts_with("a map key at $.tags contains a NUL")
        );
    }

    #[test]
    fn only_payloads_with_null_or_an_escaped_nul_are_checked() {
        assert!(may_hold_unstorable(r#"{"a":null}"#));
        assert!(may_hold_unstorable(r#"{"a":"x\u0000"}"#));
        assert!(!may_hold_unstorable(r#"{"a":1.5,"b":"x"}"#));
    }
}
