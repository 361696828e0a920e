//! The tensor names of each family's checkpoints, as transformers saves them (the bare tower,
//! or under a wrapper's prefix: `vision_model.`, `vit.`, `dinov2.`), and reading them into the
//! backend.

use crate::config::Family;
use u_sdk::{Result, UError, WeightSetBox, nn::Device, nn::Tensor};

/// Prefixes a tower's names may carry inside a larger checkpoint (`backbone.`: a DINOv2
/// backbone under a task head).
const PREFIXES: [&str; 5] = ["", "vision_model.", "vit.", "dinov2.", "backbone."];

/// One block's tensor names (without the `.weight`/`.bias` suffix).
pub struct BlockNames {
    /// Norm before attention.
    pub norm1: String,
    /// Query projection.
    pub query: String,
    /// Key projection.
    pub key: String,
    /// Value projection.
    pub value: String,
    /// Attention output projection.
    pub output: String,
    /// DINOv2's layer scale after attention (a full name).
    pub scale1: Option<String>,
    /// Norm before the MLP.
    pub norm2: String,
    /// MLP up projection.
    pub fc1: String,
    /// MLP down projection.
    pub fc2: String,
    /// DINOv2's layer scale after the MLP (a full name).
    pub scale2: Option<String>,
}

/// A checkpoint's tensors, read by the family's own names.
pub struct Names<'w> {
    weights: &'w WeightSetBox,
    family: Family,
    prefix: String,
    device: Device,
}

impl<'w> Names<'w> {
    /// The names of `family`'s tower in `weights`, found under whichever known prefix holds its
    /// patch kernel.
    pub fn new(weights: &'w WeightSetBox, family: Family, device: Device) -> Result<Names<'w>> {
        Names::under(weights, family, device, &PREFIXES)
    }

    /// The names of `family`'s tower in `weights`, found under whichever of `prefixes` holds
    /// its patch kernel.
    pub fn under(
        weights: &'w WeightSetBox,
        family: Family,
        device: Device,
        prefixes: &[&'static str],
    ) -> Result<Names<'w>> {
        let probe = |prefix: &str| Names {
            weights,
            family,
            prefix: prefix.to_string(),
            device: device.clone(),
        };
        prefixes
            .iter()
            .map(|p| probe(p))
            .find(|n| n.has(n.patch_weight()))
            .ok_or_else(|| {
                UError::invalid(format!(
                    "arch-vit: no {} patch embedding (`{}`, under {prefixes:?}) in the checkpoint",
                    family.name(),
                    probe("").patch_weight()
                ))
            })
    }

    /// The same checkpoint's names under `prefix` instead (a part beside the tower, such as
    /// LLaVA's projector).
    pub fn beside(&self, prefix: &str) -> Names<'w> {
        Names {
            weights: self.weights,
            family: self.family,
            prefix: prefix.to_string(),
            device: self.device.clone(),
        }
    }

    /// The stored name of `name`.
    pub fn stored(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The names of a part inside this one: `sub` appended to the prefix (`blocks.0.0.`).
    pub fn within(&self, sub: &str) -> Names<'w> {
        self.beside(&format!("{}{sub}", self.prefix))
    }

    /// Whether the checkpoint holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.weights
            .tensor(self.stored(name).as_str().into())
            .into_result()
            .is_ok()
    }

    /// `name` in the backend, as stored.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        self.device
            .import_weight(self.weights, &self.stored(name), None)
            .map_err(|e| UError::new(e.kind, format!("arch-vit: {}", e.message)))
    }

    /// `name` as a `[rows, cols]` matrix in the backend.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor> {
        let t = self.tensor(name)?;
        if t.dims() != [rows as u64, cols as u64] {
            return Err(UError::invalid(format!(
                "arch-vit: {} has shape {:?}, expected [{rows}, {cols}]",
                self.stored(name),
                t.dims()
            )));
        }
        Ok(t)
    }

    /// `name`'s `len` values as `F32`, whatever its shape (`[1, 1, len]` class tokens too).
    pub fn values(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let stored = self.stored(name);
        let view = self.weights.tensor(stored.as_str().into()).into_result()?;
        let v = u_sdk::quant::dequantize_view(&view)
            .map_err(|e| UError::invalid(format!("arch-vit: {stored}: {e}")))?;
        if v.len() != len {
            return Err(UError::invalid(format!(
                "arch-vit: {stored} has {} values, expected {len}",
                v.len()
            )));
        }
        Ok(v)
    }

    /// The device the tower is built on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The position table's `rows × hidden` values: [`Names::positions`], or, in a PyTorch
    /// ONNX export that folded DINOv2's `position_embeddings[:, :1]` and `[:, 1:]` into two
    /// anonymous constants (which loader-onnx names after their readers in the embeddings'
    /// scope: a `Concat` and a `Reshape`), those two joined.
    pub fn position_values(&self, rows: usize, hidden: usize) -> Result<Vec<f32>> {
        if self.has(self.positions()) || self.family != Family::Dinov2 {
            return self.values(self.positions(), rows * hidden);
        }
        let tensors = self.weights.tensors().into_result()?;
        let scope = self.stored("embeddings.");
        let find = |op: &str, want: &[u64]| {
            let found: Vec<String> = tensors
                .iter()
                .filter(|t| {
                    t.name.strip_prefix(scope.as_str()).is_some_and(|rest| {
                        rest.starts_with(op)
                            && rest.ends_with(".0")
                            && rest.matches('.').count() == 1
                    }) && t.shape.as_slice() == want
                })
                .map(|t| t.name.to_string())
                .collect();
            match found.as_slice() {
                [one] => Ok(one.clone()),
                _ => Err(UError::invalid(format!(
                    "arch-vit: no `{}` in the checkpoint, nor one {op} constant of shape {want:?} \
                     under `{scope}` (an ONNX export's folded position table)",
                    self.stored(self.positions())
                ))),
            }
        };
        let (h, patches) = (hidden as u64, rows.saturating_sub(1) as u64);
        let class = find("Concat_", &[1, 1, h])?;
        let grid = find("Reshape_", &[1, patches, h])?;
        let mut out = Vec::with_capacity(rows * hidden);
        for (name, len) in [(class, hidden), (grid, rows.saturating_sub(1) * hidden)] {
            let name = name
                .strip_prefix(self.prefix.as_str())
                .unwrap_or(&name)
                .to_string();
            out.extend(self.values(&name, len)?);
        }
        Ok(out)
    }

    /// `name` as an `F32` vector of `len` values in the backend.
    pub fn vector(&self, name: &str, len: usize) -> Result<Tensor> {
        self.device
            .from_f32(&self.values(name, len)?, &[len as u64])
    }

    /// The patch convolution's kernel.
    pub fn patch_weight(&self) -> &'static str {
        match self.family {
            Family::Vit | Family::Dinov2 => "embeddings.patch_embeddings.projection.weight",
            Family::Clip | Family::Siglip => "embeddings.patch_embedding.weight",
        }
    }

    /// The patch convolution's bias (CLIP's has none).
    pub fn patch_bias(&self) -> Option<&'static str> {
        match self.family {
            Family::Vit | Family::Dinov2 => Some("embeddings.patch_embeddings.projection.bias"),
            Family::Siglip => Some("embeddings.patch_embedding.bias"),
            Family::Clip => None,
        }
    }

    /// The class token (SigLIP has none).
    pub fn class_token(&self) -> Option<&'static str> {
        match self.family {
            Family::Vit | Family::Dinov2 => Some("embeddings.cls_token"),
            Family::Clip => Some("embeddings.class_embedding"),
            Family::Siglip => None,
        }
    }

    /// The learned position table.
    pub fn positions(&self) -> &'static str {
        match self.family {
            Family::Vit | Family::Dinov2 => "embeddings.position_embeddings",
            Family::Clip | Family::Siglip => "embeddings.position_embedding.weight",
        }
    }

    /// Block `i`'s names.
    pub fn block(&self, i: usize) -> BlockNames {
        match self.family {
            Family::Vit | Family::Dinov2 => {
                let p = |t: &str| format!("encoder.layer.{i}.{t}");
                let dino = self.family == Family::Dinov2;
                BlockNames {
                    norm1: p(if dino { "norm1" } else { "layernorm_before" }),
                    query: p("attention.attention.query"),
                    key: p("attention.attention.key"),
                    value: p("attention.attention.value"),
                    output: p("attention.output.dense"),
                    scale1: dino.then(|| p("layer_scale1.lambda1")),
                    norm2: p(if dino { "norm2" } else { "layernorm_after" }),
                    fc1: p(if dino {
                        "mlp.fc1"
                    } else {
                        "intermediate.dense"
                    }),
                    fc2: p(if dino { "mlp.fc2" } else { "output.dense" }),
                    scale2: dino.then(|| p("layer_scale2.lambda1")),
                }
            }
            Family::Clip | Family::Siglip => {
                let p = |t: &str| format!("encoder.layers.{i}.{t}");
                BlockNames {
                    norm1: p("layer_norm1"),
                    query: p("self_attn.q_proj"),
                    key: p("self_attn.k_proj"),
                    value: p("self_attn.v_proj"),
                    output: p("self_attn.out_proj"),
                    scale1: None,
                    norm2: p("layer_norm2"),
                    fc1: p("mlp.fc1"),
                    fc2: p("mlp.fc2"),
                    scale2: None,
                }
            }
        }
    }
}
