//! Reading older versions of an event: the steps `#[event(upcast(..))]` generates.
//!
//! An event type at version N may declare one upcast per older version it still reads, each
//! taking version k to k + 1, so that every version from the oldest declared one reaches N:
//! - `upcast(from = k, type = OldType)`: version k's payload is an `OldType` (any
//!   `Deserialize` type), and version k + 1's type implements `From<OldType>`;
//! - `upcast(from = k, json = function)`: where version k's type is gone, a function from
//!   its JSON to version k + 1's, `fn(serde_json::Value) -> Result<serde_json::Value, E>`
//!   with `E` any error or a `String`.
//!
//! The derive checks the chain when it compiles: a version without its upcast, two upcasts
//! for one version, a `from` at or above the event's version, or a typed upcast that would
//! convert into a version that has no type are compile errors on the token that is wrong.
//! The functions here are what the generated decode calls.

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::PayloadError;

/// The error a JSON upcast function may return: any error, a `String` or a `&str`.
pub type UpcastError = Box<dyn std::error::Error + Send + Sync>;

/// Reads a payload of an older version as its own type `T`.
#[doc(hidden)]
pub fn read_old<T: DeserializeOwned, S>(
    event_type: &str,
    version: i32,
    payload: &[u8],
) -> Result<T, PayloadError> {
    serde_json::from_slice(payload).map_err(|e| PayloadError::json::<S>(event_type, version, e))
}

/// Reads a payload of an older version as JSON, for a `json` upcast.
#[doc(hidden)]
pub fn read_json<S>(event_type: &str, version: i32, payload: &[u8]) -> Result<Value, PayloadError> {
    read_old::<Value, S>(event_type, version, payload)
}

/// Runs a `json` upcast from version `from`.
#[doc(hidden)]
pub fn upcast_json<S, E: Into<UpcastError>>(
    function: impl FnOnce(Value) -> Result<Value, E>,
    value: Value,
    event_type: &str,
    from: i32,
) -> Result<Value, PayloadError> {
    function(value).map_err(|e| PayloadError::Upcast {
        rust_type: std::any::type_name::<S>(),
        event_type: event_type.to_owned(),
        from_version: from,
        source: e.into(),
    })
}

/// Converts version N's type into version N + 1's, for a `type` upcast.
#[doc(hidden)]
pub fn upcast_into<Old, New: UpcastFrom<Old>>(old: Old) -> New {
    New::upcast_from(old)
}

/// `From<Old>`, asked for by a `type` upcast; a trait of its own for its compile error.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no `From<{Old}>`, which `#[event(upcast(.., type = {Old}))]` needs",
    label = "version N's payload type: the next version's type converts from it",
    note = "implement `From<{Old}> for {Self}`: it takes a payload of the old version to the next"
)]
pub trait UpcastFrom<Old> {
    /// `From::from`.
    fn upcast_from(old: Old) -> Self;
}

impl<Old, New: From<Old>> UpcastFrom<Old> for New {
    fn upcast_from(old: Old) -> Self {
        New::from(old)
    }
}

/// Reads the JSON an upcast produced as version `version`'s type.
#[doc(hidden)]
pub fn from_json_value<T: DeserializeOwned, S>(
    value: Value,
    event_type: &str,
    version: i32,
) -> Result<T, PayloadError> {
    serde_json::from_value(value).map_err(|e| PayloadError::json::<S>(event_type, version, e))
}

/// The text of the JSON an upcast produced, for the current version's own decode.
#[doc(hidden)]
pub fn json_bytes(value: &Value) -> Vec<u8> {
    value.to_string().into_bytes()
}
