//! The cut copy the replay log keeps of an event too large to keep whole
//! ([`super::MAX_LOGGED_EVENT_BYTES`]), made from the event's own raw parts
//! without ever holding a whole copy of a large payload: its strings are
//! cut as they are read.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::protocol::EventHead;

/// The event `name` with `payload` bounded so the frame fits in `cap`
/// bytes, and marked `clawmuxCut` (when the payload is an object).
pub(super) fn fit_parts(
    name: &str,
    payload: Option<&RawValue>,
    state_version: Option<&RawValue>,
    cap: usize,
) -> EventHead {
    // Room for the frame around the payload, and the marker.
    let around = 128 + name.len() + state_version.map_or(0, |v| v.get().len());
    let room = cap.saturating_sub(around);
    // No string longer than the first cut `bound_to` tries: what it keeps
    // of a large payload is read, nothing more.
    let read = payload
        .and_then(|p| parse_cut(p.get(), room / 2))
        .unwrap_or(Value::Null);
    let (mut payload, _) = crate::activity::bound_to(&read, room);
    drop(read);
    if let Value::Object(map) = &mut payload {
        map.insert("clawmuxCut".into(), Value::Bool(true));
    }
    let raw = serde_json::value::to_raw_value(&payload).ok();
    EventHead::encode(name, raw.as_deref(), state_version)
}

/// `json` parsed with every string longer than `max_chars` characters cut
/// to that many as it is read (as [`crate::activity::render::cut`] cuts).
/// Hand-written: serde_json's own `Value` visitor keeps every string whole.
pub(super) fn parse_cut(json: &str, max_chars: usize) -> Option<Value> {
    let mut de = serde_json::Deserializer::from_str(json);
    let value = Cutting(max_chars).deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(value)
}

#[derive(Clone, Copy)]
struct Cutting(usize);

impl<'de> DeserializeSeed<'de> for Cutting {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Cutting {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(crate::activity::render::cut(v, self.0)))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(self)?;
            members.insert(key, value);
        }
        Ok(Value::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn long_strings_are_cut_as_they_are_read_and_the_rest_kept() {
        let json = r#"{"a":"abcdefgh","b":[1,-2,3.5,true,null,"xyzéèà"],"c":{"d":"ok"}}"#;
        assert_eq!(
            parse_cut(json, 4).unwrap(),
            json!({"a":"abc…","b":[1,-2,3.5,true,null,"xyz…"],"c":{"d":"ok"}})
        );
        assert_eq!(
            parse_cut(json, 100).unwrap(),
            serde_json::from_str::<Value>(json).unwrap()
        );
        assert_eq!(
            parse_cut(r#"{"a":1} x"#, 4),
            None,
            "one value, nothing after it"
        );
    }

    #[test]
    fn a_fitted_event_is_within_its_cap_and_marked() {
        let pad = "x".repeat(100_000);
        let payload = serde_json::value::to_raw_value(&json!({"n": 7, "pad": pad})).unwrap();
        let sv = serde_json::value::to_raw_value(&json!({"health": 3})).unwrap();
        let head = fit_parts("health", Some(&payload), Some(&sv), 4096);
        assert!(head.len() <= 4096, "{} bytes", head.len());
        let frame: Value = serde_json::from_slice(&head.without_seq()).unwrap();
        assert_eq!(frame["event"], "health");
        assert_eq!(frame["payload"]["n"], 7);
        assert_eq!(frame["payload"]["clawmuxCut"], true);
        assert_eq!(frame["stateVersion"], json!({"health": 3}));
        assert!(frame["payload"]["pad"].as_str().unwrap().ends_with('…'));
    }
}
