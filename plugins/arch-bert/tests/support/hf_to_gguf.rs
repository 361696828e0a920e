//! Writes a Hugging Face BERT folder (`config.json`, F32 `model.safetensors`, and when present
//! `tokenizer.json`, `tokenizer_config.json`, `modules.json` with its pooling folder) as a GGUF
//! file in the layout llama.cpp's `convert_hf_to_gguf.py --outtype f32` (llama-cpp-python
//! 0.3.36) writes for the `bert` architecture, so that tests can make the ~90 MB file from the
//! safetensors they already fetch instead of committing it or needing torch.
//!
//! The same tensors in the same order (the safetensors names sorted, `bert.` stripped,
//! `embeddings.position_ids`, `pooler.*` and `cls.*` dropped, renamed to llama.cpp's names by
//! an independent table), the same metadata keys in the same order with the same value types:
//! the `bert.*` hyper-parameters, `bert.pooling_type` from sentence-transformers' pooling
//! module, and the vocabulary as llama.cpp's WordPiece (`tokenizer.ggml.model` `bert`: control
//! tokens as they are, `##` continuations without the `##`, every other token after a `▁`
//! word-start mark; the special token ids, whether `[CLS]`/`[SEP]` are added, lowercasing).
//! It leaves out the `general.*` keys that only describe the model card (name, license,
//! datasets, …). `tests/fixtures/gen_minilm_gguf.py` records convert_hf_to_gguf.py's output for
//! all-MiniLM-L6-v2 and `tests/gguf.rs` checks this writer's output against that record.

use anyhow::{Context, Result, bail};
use serde_json::Value as Json;
use std::path::Path;

/// `tokenizer.ggml.pre`: the pre-tokenizer convert_hf_to_gguf.py identifies, by hashing the
/// tokenizer's output on its check text, for BERT's uncased WordPiece vocabulary.
pub const PRE_TOKENIZER: &str = "jina-v2-en";

/// GGUF's alignment of tensor data (`general.alignment` absent).
const ALIGN: usize = 32;

/// A metadata value, with the GGUF value type convert_hf_to_gguf.py gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `UINT32`.
    U32(u32),
    /// `FLOAT32`.
    F32(f32),
    /// `BOOL`.
    Bool(bool),
    /// `STRING`.
    Str(String),
    /// `ARRAY` of `STRING`.
    Strs(Vec<String>),
    /// `ARRAY` of `INT32`.
    I32s(Vec<i32>),
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl Value {
    /// The value as GGUF stores it after the key: its type id, then the value (arrays: the
    /// item type, the count, the items).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let ty = |id: u32, out: &mut Vec<u8>| out.extend_from_slice(&id.to_le_bytes());
        match self {
            Value::U32(v) => {
                ty(4, &mut out);
                out.extend_from_slice(&v.to_le_bytes());
            }
            Value::F32(v) => {
                ty(6, &mut out);
                out.extend_from_slice(&v.to_le_bytes());
            }
            Value::Bool(v) => {
                ty(7, &mut out);
                out.push(u8::from(*v));
            }
            Value::Str(s) => {
                ty(8, &mut out);
                string(&mut out, s);
            }
            Value::Strs(v) => {
                ty(9, &mut out);
                ty(8, &mut out);
                out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                v.iter().for_each(|s| string(&mut out, s));
            }
            Value::I32s(v) => {
                ty(9, &mut out);
                ty(5, &mut out);
                out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                v.iter()
                    .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            }
        }
        out
    }
}

/// One F32 tensor.
#[derive(Clone, Debug)]
pub struct Tensor {
    /// llama.cpp's name.
    pub name: String,
    /// Dimensions innermost first, as GGUF stores them.
    pub dims: Vec<u64>,
    /// The values, little-endian F32.
    pub data: Vec<u8>,
}

/// A GGUF file to write.
#[derive(Clone, Debug)]
pub struct Gguf {
    /// Metadata keys and values, in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensors, in file order.
    pub tensors: Vec<Tensor>,
}

/// llama.cpp's name for a Hugging Face BERT tensor (without `bert.`), or `None` for one the
/// converter drops.
fn llama_cpp_name(hf: &str) -> Result<Option<String>> {
    if hf == "embeddings.position_ids" || hf.starts_with("pooler.") || hf.starts_with("cls.") {
        return Ok(None);
    }
    let (stem, suffix) = hf
        .rsplit_once('.')
        .context("a tensor name without a suffix")?;
    let name = match stem {
        "embeddings.word_embeddings" => "token_embd".to_string(),
        "embeddings.position_embeddings" => "position_embd".to_string(),
        "embeddings.token_type_embeddings" => "token_types".to_string(),
        "embeddings.LayerNorm" => "token_embd_norm".to_string(),
        _ => {
            let (layer, part) = stem
                .strip_prefix("encoder.layer.")
                .and_then(|r| r.split_once('.'))
                .with_context(|| format!("unknown BERT tensor {hf}"))?;
            let part = match part {
                "attention.self.query" => "attn_q",
                "attention.self.key" => "attn_k",
                "attention.self.value" => "attn_v",
                "attention.output.dense" => "attn_output",
                "attention.output.LayerNorm" => "attn_output_norm",
                "intermediate.dense" => "ffn_up",
                "output.dense" => "ffn_down",
                "output.LayerNorm" => "layer_output_norm",
                _ => bail!("unknown BERT tensor {hf}"),
            };
            format!("blk.{layer}.{part}")
        }
    };
    Ok(Some(format!("{name}.{suffix}")))
}

fn read_json(path: &Path) -> Result<Json> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// One tensor of a safetensors file.
struct Stored {
    name: String,
    dtype: String,
    /// Outermost first.
    dims: Vec<u64>,
    data: Vec<u8>,
}

/// The tensors of a safetensors file, sorted by name.
fn safetensors(path: &Path) -> Result<Vec<Stored>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let n = u64::from_le_bytes(bytes.get(..8).context("short file")?.try_into()?) as usize;
    let header: serde_json::Map<String, Json> =
        serde_json::from_slice(bytes.get(8..8 + n).context("short header")?)?;
    let data = &bytes[8 + n..];
    let mut out = Vec::new();
    for (name, info) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        let dtype = info["dtype"].as_str().unwrap_or_default().to_string();
        let dims: Vec<u64> = serde_json::from_value(info["shape"].clone())?;
        let [a, b]: [usize; 2] = serde_json::from_value(info["data_offsets"].clone())?;
        let slice = data
            .get(a..b)
            .with_context(|| format!("{name}: data out of range"))?;
        out.push(Stored {
            name: name.clone(),
            dtype,
            dims,
            data: slice.to_vec(),
        });
    }
    out.sort_by(|x, y| x.name.cmp(&y.name));
    Ok(out)
}

/// `bert.pooling_type` from sentence-transformers' pooling module, as convert_hf_to_gguf.py
/// reads it (1 mean, 2 CLS, 3 last), if the folder has one.
fn pooling_type(folder: &Path) -> Result<Option<u32>> {
    let modules = folder.join("modules.json");
    if !modules.is_file() {
        return Ok(None);
    }
    let modules = read_json(&modules)?;
    let Some(path) = modules.as_array().into_iter().flatten().find_map(|m| {
        m["type"]
            .as_str()
            .filter(|t| t.ends_with("Pooling"))
            .and(m["path"].as_str())
    }) else {
        return Ok(None);
    };
    let p = read_json(&folder.join(path).join("config.json"))?;
    let on = |k: &str| p[k].as_bool() == Some(true);
    Ok(if on("pooling_mode_mean_tokens") {
        Some(1)
    } else if on("pooling_mode_cls_token") {
        Some(2)
    } else if on("pooling_mode_lasttoken") {
        Some(3)
    } else {
        None
    })
}

/// The `tokenizer.*` keys for the WordPiece vocabulary of `tokenizer.json` (and
/// `tokenizer_config.json`'s special tokens).
fn vocabulary(folder: &Path, vocab_size: usize, type_vocab: u32) -> Result<Vec<(String, Value)>> {
    let tj = read_json(&folder.join("tokenizer.json"))?;
    let config = folder.join("tokenizer_config.json");
    let tc = if config.is_file() {
        read_json(&config)?
    } else {
        Json::Null
    };
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    for (tok, id) in tj["model"]["vocab"].as_object().context("model.vocab")? {
        let id = id.as_u64().context("a vocabulary id")? as usize;
        *tokens
            .get_mut(id)
            .context("a vocabulary id past vocab_size")? = Some(tok.clone());
    }
    let added: Vec<(&str, u64, bool)> = tj["added_tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| {
            Some((
                t["content"].as_str()?,
                t["id"].as_u64()?,
                t["special"] == true,
            ))
        })
        .collect();
    let (mut texts, mut types) = (Vec::new(), Vec::new());
    for (id, tok) in tokens.into_iter().enumerate() {
        let Some(tok) = tok else {
            texts.push(format!("[PAD{id}]"));
            types.push(5);
            continue;
        };
        let ty = match added.iter().find(|(c, _, _)| *c == tok) {
            Some((_, _, true)) => 3,
            Some(_) => 4,
            None => 1,
        };
        texts.push(match (ty, tok.strip_prefix("##")) {
            (3, _) => tok,
            (_, Some(rest)) => rest.to_string(),
            _ => format!("\u{2581}{tok}"),
        });
        types.push(ty);
    }
    let id_of = |kind: &str| {
        let content = match &tc[format!("{kind}_token")] {
            Json::String(s) => Some(s.as_str()),
            Json::Object(o) => o.get("content").and_then(Json::as_str),
            _ => None,
        }?;
        added
            .iter()
            .find(|(c, _, _)| *c == content)
            .map(|(_, id, _)| *id as u32)
    };
    let cls = id_of("cls");
    let sep = id_of("sep");
    let bos = id_of("bos").or(cls);
    let eos = id_of("eos").or(sep);
    let mut out = vec![
        (
            "tokenizer.ggml.token_type_count".into(),
            Value::U32(type_vocab),
        ),
        ("tokenizer.ggml.model".into(), Value::Str("bert".into())),
        (
            "tokenizer.ggml.pre".into(),
            Value::Str(PRE_TOKENIZER.into()),
        ),
        ("tokenizer.ggml.tokens".into(), Value::Strs(texts)),
        ("tokenizer.ggml.token_type".into(), Value::I32s(types)),
    ];
    for (key, id) in [
        ("bos", bos),
        ("eos", eos),
        ("unknown", id_of("unk")),
        ("seperator", sep),
        ("padding", id_of("pad")),
        ("mask", id_of("mask")),
    ] {
        if let Some(id) = id {
            out.push((format!("tokenizer.ggml.{key}_token_id"), Value::U32(id)));
        }
    }
    // TemplateProcessing: `[CLS] $A [SEP]` adds BOS and EOS; a pair template with two
    // separators between the sequences would add SEP.
    let post = &tj["post_processor"];
    if post["type"] == "TemplateProcessing" {
        let special = |v: &Json| -> Option<u32> {
            let name = v["SpecialToken"]["id"].as_str()?;
            added
                .iter()
                .find(|(c, _, _)| *c == name)
                .map(|(_, id, _)| *id as u32)
        };
        let single = post["single"].as_array().context("post_processor.single")?;
        let first = single.first().and_then(special);
        let last = single.last().and_then(special);
        let pair = post["pair"].as_array().cloned().unwrap_or_default();
        let middle = pair.len().saturating_sub(4);
        out.push((
            "tokenizer.ggml.add_bos_token".into(),
            Value::Bool(first.is_some() && (first == bos || first == cls)),
        ));
        out.push((
            "tokenizer.ggml.add_eos_token".into(),
            Value::Bool(last.is_some() && last == eos),
        ));
        out.push((
            "tokenizer.ggml.add_sep_token".into(),
            Value::Bool(middle == 2),
        ));
    }
    if tj["normalizer"]["type"] == "BertNormalizer"
        && let Some(lower) = tj["normalizer"]["lowercase"].as_bool()
    {
        out.push((
            "tokenizer.ggml.normalizer.lowercase".into(),
            Value::Bool(lower),
        ));
    }
    Ok(out)
}

impl Gguf {
    /// The GGUF file of the BERT checkpoint in `folder`.
    pub fn from_hf(folder: &Path) -> Result<Gguf> {
        let config = read_json(&folder.join("config.json"))?;
        let int = |k: &str| {
            config[k]
                .as_u64()
                .map(|v| v as u32)
                .with_context(|| format!("config.json lacks {k}"))
        };
        let mut metadata = vec![
            ("general.architecture".into(), Value::Str("bert".into())),
            ("general.type".into(), Value::Str("model".into())),
            (
                "bert.block_count".into(),
                Value::U32(int("num_hidden_layers")?),
            ),
            (
                "bert.context_length".into(),
                Value::U32(int("max_position_embeddings")?),
            ),
            (
                "bert.embedding_length".into(),
                Value::U32(int("hidden_size")?),
            ),
            (
                "bert.feed_forward_length".into(),
                Value::U32(int("intermediate_size")?),
            ),
            (
                "bert.attention.head_count".into(),
                Value::U32(int("num_attention_heads")?),
            ),
            (
                "bert.attention.layer_norm_epsilon".into(),
                Value::F32(config["layer_norm_eps"].as_f64().unwrap_or(1e-12) as f32),
            ),
            ("general.file_type".into(), Value::U32(0)),
            ("bert.attention.causal".into(), Value::Bool(false)),
        ];
        if let Some(p) = pooling_type(folder)? {
            metadata.push(("bert.pooling_type".into(), Value::U32(p)));
        }
        metadata.push(("general.quantization_version".into(), Value::U32(2)));
        if folder.join("tokenizer.json").is_file() {
            let type_vocab = config["type_vocab_size"].as_u64().unwrap_or(1) as u32;
            metadata.extend(vocabulary(folder, int("vocab_size")? as usize, type_vocab)?);
        }
        let mut tensors = Vec::new();
        for t in safetensors(&folder.join("model.safetensors"))? {
            let hf = t.name.strip_prefix("bert.").unwrap_or(&t.name);
            if let Some(name) = llama_cpp_name(hf)? {
                if t.dtype != "F32" {
                    bail!("{hf}: dtype {}, only F32 is written", t.dtype);
                }
                tensors.push(Tensor {
                    name,
                    dims: t.dims.into_iter().rev().collect(),
                    data: t.data,
                });
            }
        }
        Ok(Gguf { metadata, tensors })
    }

    /// The value of metadata key `key`, to change it.
    pub fn value_mut(&mut self, key: &str) -> Option<&mut Value> {
        self.metadata
            .iter_mut()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    /// Writes the file (GGUF v3).
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            string(&mut out, key);
            out.extend_from_slice(&value.encode());
        }
        let pad = |n: usize| n.div_ceil(ALIGN) * ALIGN;
        let mut offset = 0;
        for t in &self.tensors {
            string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            t.dims
                .iter()
                .for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = pad(offset + t.data.len());
        }
        out.resize(pad(out.len()), 0);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            out.resize(pad(out.len()), 0);
        }
        std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
    }
}
