//! Which type each tensor gets, as llama.cpp 0.3.36's `llama-quantize` chooses it
//! (`src/llama-quant.cpp`) for the file types `u-runner quantize` writes, without an importance
//! matrix or overrides: 1-D tensors, norms and a list of small or positional tensors keep their
//! type; `output.weight` (and `token_embd.weight` when the model has no separate output) get
//! Q6_K; the k-quant mixes (Q4_K_M, Q5_K_M) give more bits to some `attn_v` and `ffn_down`
//! layers; a row length that is not a whole number of blocks falls back to a smaller block.

use u_sdk::DType;

/// A file type: the name given on the command line, llama.cpp's `llama_ftype` number and the
/// tensor type most tensors get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileType {
    /// llama.cpp's name for it.
    pub name: &'static str,
    /// `general.file_type`.
    pub id: u32,
    /// The type of ordinary weights.
    pub default: DType,
}

/// The file types, with the names accepted for each (llama-quantize's first).
pub const FILE_TYPES: [(FileType, &[&str]); 10] = [
    (ft("F16", 1, DType::F16), &["F16"]),
    (ft("Q4_0", 2, DType::Q4_0), &["Q4_0"]),
    (ft("Q4_1", 3, DType::Q4_1), &["Q4_1"]),
    (ft("Q8_0", 7, DType::Q8_0), &["Q8_0"]),
    (ft("Q5_0", 8, DType::Q5_0), &["Q5_0"]),
    (ft("Q4_K_M", 15, DType::Q4_K), &["Q4_K_M", "Q4_K"]),
    (ft("Q5_K_M", 17, DType::Q5_K), &["Q5_K_M", "Q5_K"]),
    (ft("Q6_K", 18, DType::Q6_K), &["Q6_K"]),
    (ft("TQ1_0", 36, DType::TQ1_0), &["TQ1_0"]),
    (ft("TQ2_0", 37, DType::TQ2_0), &["TQ2_0"]),
];

const fn ft(name: &'static str, id: u32, default: DType) -> FileType {
    FileType { name, id, default }
}

/// The file type a command-line name stands for (ASCII case ignored).
pub fn file_type(name: &str) -> Option<FileType> {
    FILE_TYPES
        .iter()
        .find(|(_, names)| names.iter().any(|n| n.eq_ignore_ascii_case(name)))
        .map(|(f, _)| *f)
}

/// The hyper-parameters the choice depends on.
pub struct Model {
    /// `general.architecture`.
    pub arch: String,
    /// `<arch>.block_count`.
    pub layers: u32,
    /// `<arch>.expert_count` (0 for a dense model).
    pub experts: u32,
    /// A llama of 80 layers with grouped-query attention (llama.cpp's `LLM_TYPE_70B`).
    pub is_70b: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    AttnQkv,
    AttnKvB,
    AttnV,
    AttnK,
    AttnQ,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    use Category::*;
    if name == "output.weight" {
        return Output;
    }
    if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        return TokenEmbd;
    }
    [
        ("attn_qkv.weight", AttnQkv),
        ("attn_kv_b.weight", AttnKvB),
        ("attn_v.weight", AttnV),
        ("attn_k.weight", AttnK),
        ("attn_q.weight", AttnQ),
        ("attn_output.weight", AttnOutput),
        ("ffn_up", FfnUp),
        ("ffn_gate", FfnGate),
        ("ffn_down", FfnDown),
    ]
    .into_iter()
    .find(|(part, _)| name.contains(part))
    .map_or(Other, |(_, c)| c)
}

fn is_attn_v(c: Category) -> bool {
    matches!(c, Category::AttnV | Category::AttnQkv | Category::AttnKvB)
}

/// Parts of names llama-quantize never quantizes (small, positional or routing tensors).
const KEEP: [&str; 20] = [
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
];

/// RWKV's small 2-D `time_mix_<x>.weight` tensors that stay as they are.
const TIME_MIX: [&str; 15] = [
    "first",
    "w0",
    "w1",
    "w2",
    "v0",
    "v1",
    "v2",
    "a0",
    "a1",
    "a2",
    "g1",
    "g2",
    "decay_w1",
    "decay_w2",
    "lerp_fused",
];

/// Whether llama-quantize quantizes tensor `name` of `dims` (outermost first) at all.
pub fn quantizable(name: &str, dims: &[u64]) -> bool {
    // ggml counts dimensions up to the last one above 1 (innermost first).
    let ones = dims.iter().take_while(|&&d| d == 1).count();
    let n_dims = dims.len().saturating_sub(ones).max(1);
    n_dims >= 2
        && name.ends_with("weight")
        && !KEEP.iter().any(|k| name.contains(k))
        && !TIME_MIX
            .iter()
            .any(|t| name.contains(&format!("time_mix_{t}.weight")))
        && name != "position_embd.weight"
        && name != "token_types.weight"
}

/// The order llama.cpp visits tensors in: by layer (`blk.N.`, others first), then by name.
pub fn order_key(name: &str) -> (i64, &str) {
    (layer_of(name).map_or(-1, i64::from), name)
}

fn layer_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("blk.")?;
    let digits = rest.split('.').next()?;
    digits.parse().ok()
}

/// llama-quantize's running state over one file: how many `attn_v` and `ffn_down` tensors
/// it has typed so far.
pub struct Chooser {
    file: FileType,
    model: Model,
    tied: bool,
    n_attn_v: usize,
    i_attn_v: usize,
    i_ffn_down: usize,
    /// Tensors whose row length forced a fallback type.
    pub fallbacks: Vec<String>,
}

fn use_more_bits(i: i64, n: i64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

impl Chooser {
    /// A chooser for `file` over a model with tensors `names`.
    pub fn new<'a>(file: FileType, model: Model, names: impl Iterator<Item = &'a str>) -> Self {
        let (mut n_attn_v, mut tied) = (0, true);
        for n in names {
            let c = category(n);
            n_attn_v += usize::from(is_attn_v(c));
            tied &= c != Category::Output;
        }
        Chooser {
            file,
            model,
            tied,
            n_attn_v,
            i_attn_v: 0,
            i_ffn_down: 0,
            fallbacks: Vec::new(),
        }
    }

    /// The type of tensor `name` (`dims` outermost first, stored as `stored`); call it for
    /// every tensor in [`order_key`] order.
    pub fn choose(&mut self, name: &str, dims: &[u64], stored: DType) -> Result<DType, String> {
        if !quantizable(name, dims) {
            return Ok(stored);
        }
        let default = self.file.default;
        if !default.is_quantized() {
            return Ok(default);
        }
        let row = dims.last().copied().unwrap_or(1);
        let chosen = self.mix(name, row)?;
        Ok(self.fallback(name, row, chosen))
    }

    /// llama.cpp's `llama_tensor_get_type_impl` for the file types written here.
    fn mix(&mut self, name: &str, row: u64) -> Result<DType, String> {
        use Category::*;
        let (file, falcon) = (self.file.name, self.model.arch == "falcon");
        let (k_m, q4_k_m) = (matches!(file, "Q4_K_M" | "Q5_K_M"), file == "Q4_K_M");
        let experts = self.model.experts;
        let mut t = self.file.default;
        let c = category(name);
        if c == Output || (self.tied && c == TokenEmbd) {
            if falcon || !row.is_multiple_of(t.block_size() as u64) {
                t = DType::Q8_0;
            } else if t != DType::Q8_0 {
                t = DType::Q6_K;
            }
        } else if c == TokenEmbd {
            if matches!(file, "TQ1_0" | "TQ2_0") {
                t = DType::Q4_K;
            }
        } else if is_attn_v(c) {
            if k_m && use_more_bits(self.i_attn_v as i64, self.n_attn_v as i64) {
                t = DType::Q6_K;
            }
            if self.model.is_70b && matches!(t, DType::Q3_K | DType::Q4_K) {
                t = DType::Q5_K;
            }
            if experts == 8 {
                t = DType::Q8_0;
            }
            self.i_attn_v += 1;
        } else if c == AttnK {
            if experts == 8 {
                t = DType::Q8_0;
            }
        } else if c == FfnDown {
            let n = i64::from(self.model.layers);
            let i = if experts > 1 {
                match layer_of(name) {
                    Some(l) if i64::from(l) < n => i64::from(l),
                    _ => return Err(format!("cannot tell the layer (of {n}) of tensor {name}")),
                }
            } else {
                self.i_ffn_down as i64
            };
            if q4_k_m && falcon {
                t = if i < n / 16 {
                    DType::Q6_K
                } else if use_more_bits(i, n) {
                    DType::Q5_K
                } else {
                    DType::Q4_K
                };
            } else if k_m && use_more_bits(i, n) {
                t = DType::Q6_K;
            }
            self.i_ffn_down += 1;
        } else if c == AttnOutput {
            if !falcon && experts == 8 && q4_k_m {
                t = DType::Q5_K;
            }
        } else if c == AttnQkv {
            t = match file {
                "Q4_K_M" => DType::Q5_K,
                "Q5_K_M" => DType::Q6_K,
                _ => t,
            };
        }
        Ok(t)
    }

    /// llama.cpp's `tensor_type_fallback`: a type whose blocks fit rows of `row` values.
    fn fallback(&mut self, name: &str, row: u64, t: DType) -> DType {
        let fits = |d: DType| row.is_multiple_of(d.block_size() as u64);
        if fits(t) {
            return t;
        }
        let smaller = match t {
            DType::Q2_K | DType::Q3_K | DType::TQ1_0 | DType::TQ2_0 => DType::Q4_0,
            DType::Q4_K => DType::Q5_0,
            DType::Q5_K => DType::Q5_1,
            DType::Q6_K => DType::Q8_0,
            other => other,
        };
        let chosen = if fits(smaller) { smaller } else { DType::F16 };
        self.fallbacks.push(format!(
            "{name}: {row} values per row are not whole {t} blocks of {}: {chosen} instead",
            t.block_size()
        ));
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(layers: u32) -> Model {
        Model {
            arch: "llama".into(),
            layers,
            experts: 0,
            is_70b: false,
        }
    }

    fn names(layers: u32, tied: bool) -> Vec<String> {
        let mut n = vec!["token_embd.weight".to_string(), "output_norm.weight".into()];
        if !tied {
            n.push("output.weight".into());
        }
        for l in 0..layers {
            for t in [
                "attn_norm",
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_down",
            ] {
                n.push(format!("blk.{l}.{t}.weight"));
            }
        }
        n.sort_by(|a, b| order_key(a).cmp(&order_key(b)));
        n
    }

    fn choose_all(file: &str, layers: u32, tied: bool, row: u64) -> Vec<(String, DType)> {
        let names = names(layers, tied);
        let mut c = Chooser::new(
            file_type(file).unwrap(),
            model(layers),
            names.iter().map(|s| s.as_str()),
        );
        names
            .iter()
            .map(|n| {
                let dims: &[u64] = if n.contains("norm") {
                    &[row]
                } else {
                    &[row, row]
                };
                (n.clone(), c.choose(n, dims, DType::F32).unwrap())
            })
            .collect()
    }

    #[test]
    fn q4_k_m_gives_more_bits_where_llama_quantize_does() {
        let t = choose_all("q4_k", 8, false, 256);
        let get = |n: &str| t.iter().find(|(m, _)| m == n).unwrap().1;
        assert_eq!(get("output.weight"), DType::Q6_K);
        assert_eq!(get("token_embd.weight"), DType::Q4_K);
        assert_eq!(get("output_norm.weight"), DType::F32);
        // 8 layers: layer 0 (< n/8), 7 (≥ 7n/8) and 3, 6 ((i − 1) % 3 == 2) get Q6_K.
        for l in 0..8 {
            let more = [0, 3, 6, 7].contains(&l);
            let want = if more { DType::Q6_K } else { DType::Q4_K };
            assert_eq!(get(&format!("blk.{l}.attn_v.weight")), want, "attn_v {l}");
            assert_eq!(
                get(&format!("blk.{l}.ffn_down.weight")),
                want,
                "ffn_down {l}"
            );
            assert_eq!(get(&format!("blk.{l}.attn_q.weight")), DType::Q4_K);
        }
    }

    #[test]
    fn tied_embeddings_take_the_output_type_and_odd_rows_fall_back() {
        let t = choose_all("Q4_0", 2, true, 256);
        assert_eq!(
            t.iter().find(|(n, _)| n == "token_embd.weight").unwrap().1,
            DType::Q6_K
        );
        // 96 values per row: Q6_K's 256-value blocks do not fit, Q8_0's do; Q4_K_M falls
        // back to Q5_0; 40 fits nothing but F16.
        let t = choose_all("Q4_K_M", 2, false, 96);
        let get = |n: &str| t.iter().find(|(m, _)| m == n).unwrap().1;
        assert_eq!(get("output.weight"), DType::Q8_0);
        assert_eq!(get("blk.1.attn_q.weight"), DType::Q5_0);
        assert_eq!(get("blk.0.ffn_down.weight"), DType::Q5_0);
        assert_eq!(get("blk.1.ffn_down.weight"), DType::Q8_0);
        let t = choose_all("Q8_0", 1, false, 40);
        assert_eq!(
            t.iter()
                .find(|(n, _)| n == "blk.0.attn_q.weight")
                .unwrap()
                .1,
            DType::F16
        );
        // F16 files: every quantizable tensor F16, norms as stored.
        let t = choose_all("F16", 1, true, 40);
        assert_eq!(t[0], ("output_norm.weight".to_string(), DType::F32));
        assert_eq!(t[1], ("token_embd.weight".to_string(), DType::F16));
    }

    #[test]
    fn names_and_shapes_that_stay_unquantized() {
        assert!(quantizable("blk.0.attn_q.weight", &[64, 64]));
        assert!(!quantizable("blk.0.attn_q.weight", &[1, 64]));
        assert!(!quantizable("blk.0.attn_q.bias", &[64, 64]));
        assert!(!quantizable("blk.0.ffn_gate_inp.weight", &[8, 64]));
        assert!(!quantizable("position_embd.weight", &[512, 64]));
        assert!(!quantizable("blk.0.time_mix_w1.weight", &[64, 64]));
        assert!(quantizable("blk.0.time_mix_key.weight", &[64, 64]));
        assert_eq!(file_type("q5_k"), file_type("Q5_K_M"));
        assert_eq!(file_type("Q3_K_M"), None);
        let mut n = vec![
            "blk.10.a",
            "blk.9.b",
            "output.weight",
            "blk.9.a",
            "token_embd.weight",
        ];
        n.sort_by(|a, b| order_key(a).cmp(&order_key(b)));
        assert_eq!(
            n,
            [
                "output.weight",
                "token_embd.weight",
                "blk.9.a",
                "blk.9.b",
                "blk.10.a"
            ]
        );
    }
}
