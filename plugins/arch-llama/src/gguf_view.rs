//! The weights as a GGUF file of their family holds them ([`u_sdk::Architecture::gguf_view`]),
//! for hosts that write GGUF from an HF checkpoint (`u-runner quantize`).
//!
//! Names and hyper-parameters are [`Weights`]'s (its canonical names are GGUF's, its derived
//! keys GGUF's). What llama.cpp's converter changes beyond names is done here, tensor by tensor,
//! on first read:
//! - GPT-2's Conv1D weights, stored `[in, out]`, are transposed ([`Weights::stored_transposed`]);
//! - fused Q/K/V stored per group (GPT-NeoX, Falcon-40B) get every Q row, then K, then V
//!   ([`Weights::row_order`]);
//! - where GGUF pairs rotary dimensions otherwise than the checkpoint (the `llama` and `granite`
//!   families: adjacent pairs in GGUF, halves in HF; see [`naming::rope_style`]) the Q/K rows
//!   of each head are permuted from halves to adjacent pairs.
//!
//! Llama 3.1's RoPE scaling becomes the converter's `rope_freqs.weight`. Families whose
//! conversion does more are refused by name ([`UNCONVERTED`]), and so are HF experts stored
//! one tensor each (GGUF stacks them).

use crate::{
    naming::{self, ARCHITECTURE_KEY},
    weights::Weights,
};
use std::{collections::HashMap, sync::OnceLock};
use u_sdk::{
    DType, MetaValue, Result, RopeStyle, TensorInfo, TensorView, UError, WeightSetBox,
    weights::{SharedWeights, WeightSource},
};

/// Families whose llama.cpp conversion changes values, not only names and row order (norm
/// scales stored as `γ − 1` shifted to `γ`), which this view does not reproduce.
const UNCONVERTED: [&str; 2] = ["gemma2", "nemotron"];

/// GGUF key suffix ← `config.json` name of the settings llama.cpp's converter writes that the
/// model reads from `config.json` itself (scale factors, the parallel residual).
const CONFIG_KEYS: [(&str, &str); 6] = [
    ("use_parallel_residual", "use_parallel_residual"),
    ("embedding_scale", "embedding_multiplier"),
    ("attention.scale", "attention_multiplier"),
    ("residual_scale", "residual_multiplier"),
    ("logit_scale", "logits_scaling"),
    ("logit_scale", "logit_scale"),
];

/// How one tensor's stored rows become GGUF's.
#[derive(Clone, Debug, Default)]
struct Rewrite {
    /// Transpose the stored `[in, out]` matrix.
    transpose: bool,
    /// GGUF row `i` is stored row `order[i]`.
    order: Option<Vec<usize>>,
}

/// One tensor of the view.
struct Entry {
    info: TensorInfo,
    data: Data,
}

/// Where a tensor's GGUF bytes come from.
enum Data {
    /// The checkpoint's, as stored.
    Stored,
    /// The checkpoint's rearranged, made on first read.
    Rewritten(Rewrite, OnceLock<Vec<u8>>),
    /// Made from the configuration (`rope_freqs.weight`).
    Made(Vec<u8>),
}

/// An HF checkpoint seen as the GGUF file llama.cpp's converter would write (see the module
/// docs).
pub struct GgufView {
    weights: Weights,
    arch: String,
    metadata: Vec<(String, MetaValue)>,
    order: Vec<String>,
    entries: HashMap<String, Entry>,
}

/// The GGUF view of `set` ([`u_sdk::Architecture::gguf_view`]): GGUF weights as they are.
pub fn gguf_view(set: WeightSetBox) -> Result<WeightSetBox> {
    if set.format().into_result()?.as_str() == "gguf" {
        return Ok(set);
    }
    Ok(SharedWeights::new(GgufView::new(Weights::new(set)?)?).into_box())
}

impl GgufView {
    fn new(weights: Weights) -> Result<GgufView> {
        let arch = weights.meta_str(ARCHITECTURE_KEY).ok_or_else(|| {
            UError::invalid("arch-llama: the checkpoint names no architecture (`model_type`)")
        })?;
        if UNCONVERTED.contains(&arch.as_str()) {
            return Err(UError::unsupported(format!(
                "arch-llama: writing GGUF from a {arch} checkpoint is not supported (llama.cpp's \
                 converter shifts its norm scales); convert it with convert_hf_to_gguf.py"
            )));
        }
        let mut metadata = vec![(
            ARCHITECTURE_KEY.to_string(),
            MetaValue::Str(arch.as_str().into()),
        )];
        let prefix = format!("{arch}.");
        let mut keys: Vec<String> = weights
            .derived_keys()
            .filter(|k| k.starts_with(&prefix))
            .map(str::to_string)
            .collect();
        keys.sort();
        for k in keys {
            if let Some(v) = weights.meta(&k) {
                metadata.push((k, v));
            }
        }
        // transformers 5 moves `rope_theta` into `rope_parameters`.
        let freq_base = format!("{arch}.rope.freq_base");
        let theta = weights
            .meta_json("config.rope_parameters")
            .and_then(|r| r.get("rope_theta").and_then(|t| t.as_f64()));
        if let (None, Some(theta)) = (weights.meta(&freq_base), theta) {
            metadata.push((freq_base, MetaValue::Float(theta)));
        }
        // Settings the model reads from `config.json` directly (Granite's and Cohere's scales,
        // StableLM's parallel residual).
        for (gguf, hf) in CONFIG_KEYS {
            let key = format!("{arch}.{gguf}");
            let value = weights.meta(&format!("config.{hf}"));
            if let (false, Some(v)) = (metadata.iter().any(|(k, _)| *k == key), value) {
                metadata.push((key, v));
            }
        }
        // The context the RoPE parameters were made for (Phi-3 writes it).
        let rope = weights
            .meta_json("config.rope_parameters")
            .or_else(|| weights.meta_json("config.rope_scaling"));
        let original = rope.as_ref().and_then(|r| {
            r.get("original_max_position_embeddings")
                .and_then(|v| v.as_u64())
        });
        if let (true, Some(n)) = (arch == "phi3", original) {
            metadata.push((
                format!("{arch}.rope.scaling.original_context_length"),
                MetaValue::UInt(n),
            ));
        }
        let hparam = |k: &str| weights.meta_u64(&format!("{arch}.{k}")).map(|v| v as usize);
        let heads = hparam("attention.head_count");
        let kv_heads = hparam("attention.head_count_kv").or(heads);
        let head_dim = hparam("attention.key_length")
            .or_else(|| Some(hparam("embedding_length")? / heads.filter(|&h| h > 0)?));
        // The rotated dimensions, as the model derives them.
        let rope_dims = format!("{arch}.rope.dimension_count");
        if let (None, Some(d)) = (weights.meta(&rope_dims), head_dim) {
            let rotary = crate::config::rotary_dim(&weights, &arch, d);
            metadata.push((rope_dims, MetaValue::UInt(rotary as u64)));
        }
        let permutes = naming::rope_style("gguf", &arch) == RopeStyle::Normal
            && naming::rope_style(weights.format(), &arch) == RopeStyle::NeoX;
        let mut order: Vec<String> = weights.shapes().map(|(name, _)| name.clone()).collect();
        order.sort();
        let mut entries = HashMap::new();
        for name in &order {
            if is_per_expert(name) {
                return Err(UError::unsupported(format!(
                    "arch-llama: `{name}`: writing GGUF from experts stored one tensor each is \
                     not supported (GGUF stacks them); convert with convert_hf_to_gguf.py"
                )));
            }
            let stored = weights.view(name)?;
            let mut shape = stored.shape.to_vec();
            let rows = shape.first().copied().unwrap_or(1) as usize;
            let mut rewrite = Rewrite::default();
            if weights.stored_transposed(name) {
                if shape.len() != 2 {
                    return Err(UError::invalid(format!(
                        "arch-llama: {name} has shape {shape:?}, expected a matrix"
                    )));
                }
                shape.swap(0, 1);
                rewrite.transpose = true;
            }
            let gguf_rows = shape.first().copied().unwrap_or(1) as usize;
            rewrite.order = weights.row_order(name, rows);
            if permutes {
                let group = if is_projection(name, "attn_q") {
                    Some(heads)
                } else if is_projection(name, "attn_k") {
                    Some(kv_heads)
                } else {
                    None
                };
                if let Some(h) = group {
                    rewrite.order = Some(pairs_adjacent(name, gguf_rows, h)?);
                }
            }
            let info = TensorInfo {
                name: name.as_str().into(),
                dtype: stored.dtype,
                shape: shape.into(),
                byte_len: stored.data.len() as u64,
            };
            let data = if rewrite.transpose || rewrite.order.is_some() {
                Data::Rewritten(rewrite, OnceLock::new())
            } else {
                Data::Stored
            };
            entries.insert(name.clone(), Entry { info, data });
        }
        // llama.cpp's Falcon converter writes a context of 2048 whatever `config.json` says,
        // and names the Q/K/V regrouping it did.
        if arch == "falcon" {
            let key = format!("{arch}.context_length");
            metadata.retain(|(k, _)| *k != key);
            metadata.push((key, MetaValue::UInt(2048)));
            metadata.push((
                format!("{arch}.tensor_data_layout"),
                MetaValue::Str("jploski".into()),
            ));
        }
        // The feed-forward width where `config.json` leaves it implied (GPT-2's `n_inner`):
        // the input width of the first down projection.
        let ffn = format!("{arch}.feed_forward_length");
        let down = entries
            .get("blk.0.ffn_down.weight")
            .map(|e| e.info.shape.to_vec());
        if let (false, Some([_, width])) =
            (metadata.iter().any(|(k, _)| *k == ffn), down.as_deref())
        {
            metadata.push((ffn, MetaValue::UInt(*width)));
        }
        if let Some(factors) = llama3_rope_factors(&weights, &arch, head_dim)? {
            let name = "rope_freqs.weight".to_string();
            let bytes: Vec<u8> = factors.iter().flat_map(|f| f.to_le_bytes()).collect();
            let info = TensorInfo {
                name: name.as_str().into(),
                dtype: DType::F32,
                shape: vec![factors.len() as u64].into(),
                byte_len: bytes.len() as u64,
            };
            let at = order.partition_point(|n| n < &name);
            order.insert(at, name.clone());
            entries.insert(
                name,
                Entry {
                    info,
                    data: Data::Made(bytes),
                },
            );
        }
        Ok(GgufView {
            weights,
            arch,
            metadata,
            order,
            entries,
        })
    }

    /// The GGUF bytes of tensor `name` under `rewrite`.
    fn rewritten(&self, name: &str, rewrite: &Rewrite) -> Result<Vec<u8>> {
        let stored = self.weights.view(name)?;
        let size = element_size(stored.dtype).ok_or_else(|| {
            UError::unsupported(format!(
                "arch-llama: {name} is {}; its rows can be rearranged only in F32, F16 or BF16",
                stored.dtype
            ))
        })?;
        let data = stored.data.as_slice();
        let mut bytes = if rewrite.transpose {
            let (r, c) = (stored.shape[0] as usize, stored.shape[1] as usize);
            let mut t = vec![0u8; data.len()];
            for i in 0..r {
                for j in 0..c {
                    let (from, to) = ((i * c + j) * size, (j * r + i) * size);
                    t[to..to + size].copy_from_slice(&data[from..from + size]);
                }
            }
            t
        } else {
            data.to_vec()
        };
        if let Some(order) = &rewrite.order {
            let row = bytes.len() / order.len().max(1);
            let src = bytes.clone();
            for (i, &from) in order.iter().enumerate() {
                bytes[i * row..(i + 1) * row].copy_from_slice(&src[from * row..(from + 1) * row]);
            }
        }
        Ok(bytes)
    }
}

impl WeightSource for GgufView {
    const FORMAT: &'static str = "gguf";

    fn architecture(&self) -> Option<&str> {
        Some(&self.arch)
    }

    fn metadata_keys(&self) -> Vec<&str> {
        self.metadata.iter().map(|(k, _)| k.as_str()).collect()
    }

    fn metadata(&self, key: &str) -> Option<MetaValue> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn tensors(&self) -> Vec<TensorInfo> {
        self.order
            .iter()
            .filter_map(|n| self.entries.get(n))
            .map(|e| e.info.clone())
            .collect()
    }

    fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let entry = self
            .entries
            .get(name)
            .ok_or_else(|| UError::not_found(format!("arch-llama: tensor `{name}` is missing")))?;
        let data = match &entry.data {
            Data::Stored => return self.weights.view(name),
            Data::Made(bytes) => bytes,
            Data::Rewritten(rewrite, cell) => match cell.get() {
                Some(bytes) => bytes,
                None => {
                    let bytes = self.rewritten(name, rewrite)?;
                    cell.get_or_init(|| bytes)
                }
            },
        };
        Ok(TensorView {
            dtype: entry.info.dtype,
            shape: entry.info.shape.clone(),
            data: data.as_slice().into(),
        })
    }
}

/// Llama 3.1's RoPE scaling (`rope_type: llama3` in the checkpoint's `rope_parameters` or
/// `rope_scaling`) as llama.cpp's converter writes it: per-frequency divisors of the base
/// inverse frequencies (`rope_freqs.weight`), computed in f64 from `θ_i = base^(−2i/d)`.
fn llama3_rope_factors(
    w: &Weights,
    arch: &str,
    head_dim: Option<usize>,
) -> Result<Option<Vec<f32>>> {
    let rope = w
        .meta_json("config.rope_parameters")
        .or_else(|| w.meta_json("config.rope_scaling"));
    let get = |k: &str| rope.as_ref().and_then(|r| r.get(k));
    let kind = get("rope_type")
        .or_else(|| get("type"))
        .and_then(|t| t.as_str());
    if arch != "llama" || kind != Some("llama3") {
        return Ok(None);
    }
    let num = |k: &str, default: f64| get(k).and_then(|v| v.as_f64()).unwrap_or(default);
    let head_dim = head_dim
        .ok_or_else(|| UError::invalid("arch-llama: Llama 3 RoPE scaling without a head size"))?;
    let base = w
        .meta_f64(&format!("{arch}.rope.freq_base"))
        .unwrap_or_else(|| num("rope_theta", 10_000.0));
    let (factor, low, high) = (
        num("factor", 8.0),
        num("low_freq_factor", 1.0),
        num("high_freq_factor", 4.0),
    );
    let old = num("original_max_position_embeddings", 8192.0);
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    Ok(Some(
        (0..head_dim)
            .step_by(2)
            .map(|i| {
                let freq = 1.0 / base.powf(i as f64 / head_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let divisor = if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                divisor as f32
            })
            .collect(),
    ))
}

/// Bytes per element of the float types whose rows this view rearranges.
fn element_size(dtype: DType) -> Option<usize> {
    match dtype {
        DType::F32 => Some(4),
        DType::F16 | DType::BF16 => Some(2),
        _ => None,
    }
}

/// Whether `name` is `blk.{i}.{projection}.weight` or `.bias`.
fn is_projection(name: &str, projection: &str) -> bool {
    name.starts_with("blk.")
        && (name.ends_with(&format!(".{projection}.weight"))
            || name.ends_with(&format!(".{projection}.bias")))
}

/// Whether `name` is one expert's tensor (`blk.{i}.ffn_gate.{e}.weight`).
fn is_per_expert(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    matches!(parts.as_slice(), ["blk", _, _, e, "weight"] if e.parse::<usize>().is_ok())
}

/// The row order that turns `heads` heads of half-split rotary rows (HF: dimension `j` pairs
/// with `j + d/2`) into adjacent pairs (GGUF `llama`: `2j` with `2j + 1`): GGUF row
/// `h·d + 2j + s` is stored row `h·d + s·d/2 + j`.
fn pairs_adjacent(name: &str, rows: usize, heads: Option<usize>) -> Result<Vec<usize>> {
    let heads = heads
        .filter(|&h| h > 0 && rows.is_multiple_of(2 * h))
        .ok_or_else(|| {
            UError::invalid(format!(
                "arch-llama: {name}: {rows} rows do not split into {heads:?} heads of pairs"
            ))
        })?;
    let d = rows / heads;
    Ok((0..rows)
        .map(|r| {
            let (h, i) = (r / d, r % d);
            h * d + (i % 2) * (d / 2) + i / 2
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_pairs_interleave_each_heads_halves() {
        // Two heads of four: HF rows (0 1 | 2 3) pair 0–2 and 1–3; GGUF wants 0 2 1 3.
        assert_eq!(
            pairs_adjacent("q", 8, Some(2)).unwrap(),
            vec![0, 2, 1, 3, 4, 6, 5, 7]
        );
        assert!(pairs_adjacent("q", 6, Some(2)).is_err());
        assert!(pairs_adjacent("q", 8, None).is_err());
    }

    #[test]
    fn per_expert_names_are_told_from_layer_names() {
        assert!(is_per_expert("blk.0.ffn_up.5.weight"));
        assert!(!is_per_expert("blk.0.ffn_up.weight"));
        assert!(!is_per_expert("blk.0.ffn_up_exps.weight"));
    }
}
