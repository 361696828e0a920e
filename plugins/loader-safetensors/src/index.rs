//! `model.safetensors.index.json`: which shard file holds which tensor.

use serde_json::{Map, Value};

/// The largest index file accepted (64 MiB; real ones are well under 1 MiB).
pub const MAX_INDEX_LEN: u64 = 64 * 1024 * 1024;

/// A parsed shard index.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ShardIndex {
    /// `(tensor name, shard file name)`, sorted by tensor name.
    pub weight_map: Vec<(String, String)>,
    /// Shard file names, each once, sorted (`model-00001-of-00002…` first).
    pub shards: Vec<String>,
    /// The free-form `metadata` object (e.g. `total_size`), if any.
    pub metadata: Map<String, Value>,
}

/// Parses an index document. Shard names must be plain file names in the index's directory:
/// no separators, no `.`/`..`, no NUL — an index cannot point outside its directory.
pub fn parse(bytes: &[u8]) -> Result<ShardIndex, String> {
    let root: Map<String, Value> =
        serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON: {e}"))?;
    let metadata = match root.get("metadata") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => return Err("`metadata` is not an object".to_string()),
    };
    let map = root
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or("`weight_map` is missing or not an object")?;
    let mut index = ShardIndex {
        metadata,
        ..ShardIndex::default()
    };
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| format!("weight_map entry `{tensor}` is not a string"))?;
        check_file_name(file)?;
        if !index.shards.iter().any(|s| s == file) {
            index.shards.push(file.to_string());
        }
        index.weight_map.push((tensor.clone(), file.to_string()));
    }
    index.shards.sort();
    if index.weight_map.is_empty() {
        return Err("`weight_map` is empty".to_string());
    }
    Ok(index)
}

fn check_file_name(file: &str) -> Result<(), String> {
    if file.is_empty() || file == "." || file == ".." || file.contains(['/', '\\', '\0']) {
        return Err(format!(
            "shard `{file}` is not a plain file name in the index's directory"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_weight_map() {
        let idx = parse(
            br#"{"metadata":{"total_size":16},"weight_map":{"b":"s2.safetensors","a":"s1.safetensors","c":"s1.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(idx.shards, vec!["s1.safetensors", "s2.safetensors"]);
        assert_eq!(idx.weight_map.len(), 3);
        assert_eq!(idx.metadata["total_size"], 16);
    }

    #[test]
    fn refuses_escaping_or_malformed_indexes() {
        for (doc, want) in [
            (
                r#"{"weight_map":{"a":"../x.safetensors"}}"#,
                "plain file name",
            ),
            (r#"{"weight_map":{"a":"/etc/passwd"}}"#, "plain file name"),
            (r#"{"weight_map":{"a":".."}}"#, "plain file name"),
            (r#"{"weight_map":{"a":1}}"#, "not a string"),
            (r#"{"weight_map":{}}"#, "empty"),
            (r#"{"weight_map":[]}"#, "missing"),
            (r#"{"metadata":1,"weight_map":{"a":"b"}}"#, "metadata"),
            (r#"{"#, "JSON"),
        ] {
            let err = parse(doc.as_bytes()).expect_err(doc);
            assert!(err.contains(want), "{doc}: {err}");
        }
    }
}
