//! Decoding one request's fields from its JSON object, naming the offending field on error.
//!
//! `serde_json::from_value` says "invalid type: string \"x\", expected i64" without saying
//! *which* field; a client needs the name. [`from_map`] drives the derived `Deserialize` of a
//! request struct through a map accessor that remembers the key being decoded and prefixes
//! every value error with it ("field `priority`: invalid type: …"). Requests are flat objects,
//! so one level of key tracking is all that is needed.

use std::fmt;

use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer, MapAccess, Visitor};
use serde_json::{Map, Value};

/// A decoding error: one line, naming the field when there is one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamError(pub String);

impl fmt::Display for ParamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParamError {}

impl de::Error for ParamError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        ParamError(msg.to_string())
    }
}

/// Decodes `T` from the fields of a request object (the `id` and `op` keys already removed).
pub fn from_map<T: DeserializeOwned>(map: Map<String, Value>) -> Result<T, ParamError> {
    T::deserialize(Fields(map))
}

/// The request object as a serde `Deserializer`.
struct Fields(Map<String, Value>);

impl<'de> de::Deserializer<'de> for Fields {
    type Error = ParamError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ParamError> {
        visitor.visit_map(FieldAccess {
            iter: self.0.into_iter(),
            value: None,
        })
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map struct enum identifier ignored_any
    }
}

struct FieldAccess {
    iter: serde_json::map::IntoIter,
    /// The key just handed out and its value, waiting for `next_value_seed`.
    value: Option<(String, Value)>,
}

impl<'de> MapAccess<'de> for FieldAccess {
    type Error = ParamError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ParamError> {
        let Some((key, value)) = self.iter.next() else {
            return Ok(None);
        };
        let decoded = seed.deserialize(key.as_str().into_deserializer())?;
        self.value = Some((key, value));
        Ok(Some(decoded))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, ParamError> {
        let (key, value) = self
            .value
            .take()
            .ok_or_else(|| ParamError("internal: value requested before its key".into()))?;
        seed.deserialize(value)
            .map_err(|e| ParamError(format!("field `{key}`: {e}")))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.iter.len())
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        task: i64,
        #[serde(default)]
        note: Option<String>,
    }

    fn decode(v: Value) -> Result<Sample, ParamError> {
        match v {
            Value::Object(m) => from_map(m),
            _ => unreachable!(),
        }
    }

    #[test]
    fn names_the_field_with_the_wrong_type() {
        let err = decode(json!({"task": "seven"})).unwrap_err();
        assert!(
            err.0.starts_with("field `task`: invalid type: string"),
            "{err}"
        );
    }

    #[test]
    fn names_unknown_and_missing_fields() {
        let err = decode(json!({"task": 1, "bogus": true})).unwrap_err();
        assert!(err.0.contains("unknown field `bogus`"), "{err}");
        let err = decode(json!({"note": "x"})).unwrap_err();
        assert!(err.0.contains("missing field `task`"), "{err}");
    }

    #[test]
    fn decodes_optional_and_null_fields() {
        assert_eq!(
            decode(json!({"task": 3, "note": null})).unwrap(),
            Sample {
                task: 3,
                note: None
            }
        );
        assert_eq!(
            decode(json!({"task": 3, "note": "hi"})).unwrap(),
            Sample {
                task: 3,
                note: Some("hi".into())
            }
        );
    }
}
