//! Typed access to the fields of a JSON request body, with 400s that name the field.

use crate::error::ApiError;
use serde_json::{Map, Value};

/// A JSON object.
pub type Obj = Map<String, Value>;

/// Parses `body` as a UTF-8 JSON object.
pub fn object(body: &[u8]) -> Result<Obj, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid UTF-8 ({e})")))?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(o) => Ok(o),
        other => Err(ApiError::invalid(format!(
            "the request body must be a JSON object, got {}",
            type_name(&other)
        ))),
    }
}

/// A number in `lo..=hi`, if present.
pub fn number(o: &Obj, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let v = n.as_f64().unwrap_or(f64::NAN);
            if (lo..=hi).contains(&v) {
                Ok(Some(v))
            } else {
                Err(ApiError::param(
                    key,
                    format!("`{key}` must be between {lo} and {hi}, got {v}"),
                ))
            }
        }
        Some(other) => Err(ApiError::param(
            key,
            format!("`{key}` must be a number, got {}", type_name(other)),
        )),
    }
}

/// An integer, if present.
pub fn integer(o: &Obj, key: &str) -> Result<Option<i64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {
            Ok(Some(n.as_i64().unwrap_or(i64::MAX)))
        }
        Some(other) => Err(ApiError::param(
            key,
            format!("`{key}` must be an integer, got {}", type_name(other)),
        )),
    }
}

/// An integer in `lo..=hi`, if present.
pub fn integer_in(o: &Obj, key: &str, lo: i64, hi: i64) -> Result<Option<u32>, ApiError> {
    match integer(o, key)? {
        None => Ok(None),
        Some(v) if (lo..=hi).contains(&v) => Ok(Some(v as u32)),
        Some(v) => Err(ApiError::param(
            key,
            format!("`{key}` must be between {lo} and {hi}, got {v}"),
        )),
    }
}

/// A boolean; absent means `false`.
pub fn boolean(o: &Obj, key: &str) -> Result<bool, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::param(
            key,
            format!("`{key}` must be a boolean, got {}", type_name(other)),
        )),
    }
}

/// A string, if present.
pub fn string(o: &Obj, key: &str) -> Result<Option<String>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ApiError::param(
            key,
            format!("`{key}` must be a string, got {}", type_name(other)),
        )),
    }
}

/// A nested object, if present.
pub fn nested<'a>(o: &'a Obj, key: &str) -> Result<Option<&'a Obj>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(other) => Err(ApiError::param(
            key,
            format!("`{key}` must be an object, got {}", type_name(other)),
        )),
    }
}

/// A string that must be present.
pub fn required_string(o: &Obj, key: &str) -> Result<String, ApiError> {
    string(o, key)?.ok_or_else(|| ApiError::param(key, format!("you must provide `{key}`")))
}

/// A string or an array of strings (`stop` and `stop_sequences`), as a list.
pub fn strings(o: &Obj, key: &str) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::param(
            key,
            format!("`{key}` must be a string or an array of strings"),
        )
    };
    match o.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(bad))
            .collect(),
        Some(_) => Err(bad()),
    }
}

/// A non-empty array that must be present.
pub fn nonempty_array<'a>(o: &'a Obj, key: &str) -> Result<&'a Vec<Value>, ApiError> {
    match o.get(key) {
        Some(Value::Array(list)) if !list.is_empty() => Ok(list),
        Some(Value::Array(_)) => Err(ApiError::param(key, format!("`{key}` must not be empty"))),
        None | Some(Value::Null) => Err(ApiError::param(key, format!("you must provide `{key}`"))),
        Some(other) => Err(ApiError::param(
            key,
            format!("`{key}` must be an array, got {}", type_name(other)),
        )),
    }
}

/// How a value's type is named in error messages.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `max_tokens` (or a newer alias) as at least 1, or `default` when absent.
pub fn max_tokens(o: &Obj, keys: &[&str], default: Option<u32>) -> Result<u32, ApiError> {
    for key in keys {
        if let Some(n) = integer(o, key)? {
            return u32::try_from(n)
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| ApiError::param(key, format!("`{key}` must be at least 1")));
        }
    }
    default.ok_or_else(|| ApiError::param(keys[0], format!("you must provide `{}`", keys[0])))
}

/// An optional array `key` of objects of `shape` (e.g. `{"id", "scale"}`), each read by
/// `each`, which is given the object and a maker of errors naming `key[i]`.
fn objects<T>(
    o: &Obj,
    key: &str,
    shape: &str,
    each: impl Fn(&Obj, &dyn Fn(&str) -> ApiError) -> Result<T, ApiError>,
) -> Result<Vec<T>, ApiError> {
    let list = match o.get(key) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(other) => {
            return Err(ApiError::param(
                key,
                format!(
                    "`{key}` must be an array of {shape}, got {}",
                    type_name(other)
                ),
            ));
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, entry)| {
            let at = format!("{key}[{i}]");
            let bad = |why: &str| ApiError::param(&at, format!("`{at}` {why}"));
            match entry {
                Value::Object(e) => each(e, &bad),
                _ => Err(bad(&format!("must be an object {shape}"))),
            }
        })
        .collect()
}

/// Multiplier `key` of an entry: 1 when absent, else a finite number within ±1000.
fn multiplier(e: &Obj, key: &str, bad: &dyn Fn(&str) -> ApiError) -> Result<f32, ApiError> {
    match e.get(key) {
        None | Some(Value::Null) => Ok(1.0),
        Some(v) => match v.as_f64() {
            Some(s) if s.is_finite() && s.abs() <= 1e3 => Ok(s as f32),
            _ => Err(bad(&format!(
                "has a `{key}` that is not a number within ±1000"
            ))),
        },
    }
}

/// llama.cpp's per-request `lora`: `[{"id": 0 | "name", "scale": 1.0}]`, the adapters a request
/// runs under. A string id is the adapter's name; an integer id `N` is sent on as `#N`, the
/// `N`-th adapter the engine lists (by name).
pub fn adapters(o: &Obj, key: &str) -> Result<Vec<u_sdk::AdapterUse>, ApiError> {
    objects(o, key, r#"{"id", "scale"}"#, |e, bad| {
        let name = match e.get("id") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(Value::Number(n)) if n.as_u64().is_some() => format!("#{n}"),
            _ => return Err(bad("needs an `id`: the adapter's name or index")),
        };
        Ok(u_sdk::AdapterUse {
            name: name.into(),
            scale: multiplier(e, "scale", bad)?,
        })
    })
}

/// `control_vectors`: `[{"name", "strength", "layers": [first, last]}]`, the control vectors a
/// request runs under (strength 1 and every block unless given).
pub fn control_vectors(o: &Obj, key: &str) -> Result<Vec<u_sdk::ControlUse>, ApiError> {
    objects(o, key, r#"{"name", "strength", "layers"}"#, |e, bad| {
        let name = match e.get("name") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            _ => return Err(bad("needs a `name`")),
        };
        let strength = multiplier(e, "strength", bad)?;
        let layers = match e.get("layers") {
            None | Some(Value::Null) => Some((0, u32::MAX)),
            Some(Value::Array(r)) => match (
                r.first().and_then(Value::as_u64),
                r.get(1).and_then(Value::as_u64),
            ) {
                (Some(a), Some(b)) if r.len() == 2 && a <= b && b < u64::from(u32::MAX) => {
                    Some((a as u32, b as u32))
                }
                _ => None,
            },
            Some(_) => None,
        };
        let Some((first_layer, last_layer)) = layers else {
            return Err(bad("has `layers` that are not [first, last] block numbers"));
        };
        Ok(u_sdk::ControlUse {
            name: name.into(),
            strength,
            first_layer,
            last_layer,
        })
    })
}
