//! The layers every block is made of — convolution, linear, group and layer normalisation —
//! read from a component's tensors (diffusers' names, or a single-file checkpoint's through
//! [`crate::ldm`]) into the backend.
//!
//! Feature maps are `[channels, height, width]` tensors; rows (the sequence a transformer
//! sees) are `[positions, channels]`.

use crate::ldm::Renamed;
use u_sdk::{
    Result, UError, WeightSetBox,
    nn::{Device, Tensor},
};

/// A component's tensors, read into the backend.
pub struct Weights<'w> {
    set: &'w WeightSetBox,
    device: Device,
    renamed: Option<Renamed>,
}

impl<'w> Weights<'w> {
    /// The tensors of `set`, for `device`.
    pub fn new(set: &'w WeightSetBox, device: Device) -> Self {
        Self {
            set,
            device,
            renamed: None,
        }
    }

    /// These tensors read through `renamed` (a component of a single-file checkpoint), or as
    /// named when `None`.
    pub fn renamed(self, renamed: Option<Renamed>) -> Self {
        Self { renamed, ..self }
    }

    /// The stored tensor standing for the diffusers name `name`.
    fn stored<'n>(&'n self, name: &'n str) -> (&'n str, bool) {
        match self.renamed.as_ref().and_then(|r| r.get(name)) {
            Some(s) => (&s.name, s.squeeze),
            None => (name, false),
        }
    }

    /// The device the layers compute on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the component has a tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        let (stored, _) = self.stored(name);
        self.set.tensor(stored.into()).into_result().is_ok()
    }

    /// `name` in the backend, as stored (a 1×1 convolution standing for a linear layer as
    /// its matrix).
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let (stored, squeeze) = self.stored(name);
        let t = self
            .device
            .import_weight(self.set, stored, None)
            .map_err(|e| UError::new(e.kind, format!("arch-diffusion: {}", e.message)))?;
        match (squeeze, t.dims()) {
            (true, &[o, i, 1, 1]) => t.reshape(&[o, i]),
            _ => Ok(t),
        }
    }

    /// `name` as an `F32` vector in the backend, its length checked when `len` is given.
    pub fn vector(&self, name: &str, len: Option<usize>) -> Result<Tensor> {
        let v = self.values(name)?;
        if len.is_some_and(|n| n != v.len()) {
            return Err(UError::invalid(format!(
                "arch-diffusion: {name} has {} values, expected {}",
                v.len(),
                len.unwrap_or_default()
            )));
        }
        self.device.from_f32(&v, &[v.len() as u64])
    }

    /// The values of `name`, dequantized to `f32` on the host.
    pub fn values(&self, name: &str) -> Result<Vec<f32>> {
        let (stored, _) = self.stored(name);
        let view = self.set.tensor(stored.into()).into_result()?;
        u_sdk::quant::dequantize_view(&view)
            .map_err(|e| UError::invalid(format!("arch-diffusion: {name}: {e}")))
    }
}

fn shape_error(name: &str, dims: &[u64], want: &str) -> UError {
    UError::invalid(format!(
        "arch-diffusion: {name} has shape {dims:?}, expected {want}"
    ))
}

/// A 2-D convolution with a bias.
pub struct Conv2d {
    weight: Tensor,
    bias: Tensor,
    stride: u32,
    padding: [u32; 2],
}

impl Conv2d {
    /// `{prefix}.weight` `[c_out, c_in, k, k]` and `{prefix}.bias`, with "same" padding for an
    /// odd kernel at stride 1.
    pub fn load(w: &Weights<'_>, prefix: &str) -> Result<Conv2d> {
        let weight = w.tensor(&format!("{prefix}.weight"))?;
        let k = match weight.dims() {
            &[_, _, kh, kw] if kh == kw && !kh.is_multiple_of(2) => kh as u32,
            d => return Err(shape_error(prefix, d, "an odd square kernel")),
        };
        Self::with(w, prefix, weight, 1, [k / 2; 2])
    }

    /// A `patch × patch` convolution of stride `patch` (a patch embedding).
    pub fn patches(w: &Weights<'_>, prefix: &str, patch: usize) -> Result<Conv2d> {
        let weight = w.tensor(&format!("{prefix}.weight"))?;
        let p = patch as u64;
        if !matches!(weight.dims(), &[_, _, kh, kw] if kh == p && kw == p) {
            return Err(shape_error(
                prefix,
                weight.dims(),
                &format!("a {p}×{p} kernel"),
            ));
        }
        Self::with(w, prefix, weight, patch as u32, [0, 0])
    }

    /// A 3×3 convolution of stride 2 with `padding` zeros before and after (a downsampler).
    pub fn strided(w: &Weights<'_>, prefix: &str, padding: [u32; 2]) -> Result<Conv2d> {
        let weight = w.tensor(&format!("{prefix}.weight"))?;
        if !matches!(weight.dims(), &[_, _, 3, 3]) {
            return Err(shape_error(prefix, weight.dims(), "a 3×3 kernel"));
        }
        Self::with(w, prefix, weight, 2, padding)
    }

    fn with(
        w: &Weights<'_>,
        prefix: &str,
        weight: Tensor,
        stride: u32,
        padding: [u32; 2],
    ) -> Result<Conv2d> {
        let c_out = weight.dims()[0] as usize;
        Ok(Conv2d {
            bias: w.vector(&format!("{prefix}.bias"), Some(c_out))?,
            weight,
            stride,
            padding,
        })
    }

    /// Input channels.
    pub fn in_channels(&self) -> usize {
        self.weight.dims()[1] as usize
    }

    /// Output channels.
    pub fn out_channels(&self) -> usize {
        self.weight.dims()[0] as usize
    }

    /// The convolution of `x` `[c_in, h, w]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv2d(&self.weight, Some(&self.bias), self.stride, self.padding)
    }

    /// The convolution of `x` with `shift` (one value per output channel) added to its bias.
    pub fn forward_shifted(&self, x: &Tensor, shift: &Tensor) -> Result<Tensor> {
        let bias = self.bias.add(&shift.reshape(self.bias.dims())?)?;
        x.conv2d(&self.weight, Some(&bias), self.stride, self.padding)
    }
}

/// `y = x·Wᵀ (+ b)`.
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// `{prefix}.weight` `[out, in]` and, when the component has one, `{prefix}.bias`.
    pub fn load(w: &Weights<'_>, prefix: &str) -> Result<Linear> {
        let weight = w.tensor(&format!("{prefix}.weight"))?;
        if weight.dims().len() != 2 {
            return Err(shape_error(prefix, weight.dims(), "[out, in]"));
        }
        let bias_name = format!("{prefix}.bias");
        let bias = match w.has(&bias_name) {
            true => Some(w.vector(&bias_name, Some(weight.dims()[0] as usize))?),
            false => None,
        };
        Ok(Linear { weight, bias })
    }

    /// Rows `range` of the output only: the layer that computes that slice of `prefix`'s
    /// outputs (GEGLU's two halves of one projection).
    pub fn load_rows(
        w: &Weights<'_>,
        prefix: &str,
        range: std::ops::Range<usize>,
    ) -> Result<Linear> {
        let full = Self::load(w, prefix)?;
        if range.end > full.out_features() {
            return Err(shape_error(
                prefix,
                full.weight.dims(),
                &format!("at least {} outputs", range.end),
            ));
        }
        let bias = match &full.bias {
            Some(_) => {
                let all = w.values(&format!("{prefix}.bias"))?;
                let part = &all[range.clone()];
                Some(w.device().from_f32(part, &[part.len() as u64])?)
            }
            None => None,
        };
        Ok(Linear {
            weight: full.weight.rows_range(range)?,
            bias,
        })
    }

    /// `{prefix}` as two layers over the input's first `first` columns (with the bias) and the
    /// rest (without): `y = W·[a; b] + bias = (W_a·a + bias) + W_b·b`, for an input that
    /// arrives in two parts (FLUX's single blocks: the attention's output and the MLP's).
    pub fn load_column_split(
        w: &Weights<'_>,
        prefix: &str,
        first: usize,
    ) -> Result<(Linear, Linear)> {
        let full = Self::load(w, prefix)?;
        let (rows, cols) = (full.out_features(), full.in_features());
        if first == 0 || first >= cols {
            return Err(shape_error(
                prefix,
                full.weight.dims(),
                &format!("more than {first} inputs"),
            ));
        }
        let values = w.values(&format!("{prefix}.weight"))?;
        let part = |range: std::ops::Range<usize>| -> Result<Tensor> {
            let data: Vec<f32> = values
                .chunks_exact(cols)
                .flat_map(|row| row[range.clone()].iter().copied())
                .collect();
            w.device()
                .from_f32(&data, &[rows as u64, range.len() as u64])
        };
        Ok((
            Linear {
                weight: part(0..first)?,
                bias: full.bias,
            },
            Linear {
                weight: part(first..cols)?,
                bias: None,
            },
        ))
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.weight.dims()[1] as usize
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0] as usize
    }

    /// The layer applied to each row of `x` `[rows, in]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul_t(&self.weight)?;
        if let Some(b) = &self.bias {
            y.add_assign(b)?;
        }
        Ok(y)
    }
}

/// Group normalisation (Wu & He 2018) of a feature map, scale and shift per channel.
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: u32,
    eps: f32,
}

impl GroupNorm {
    /// `{prefix}.weight` and `{prefix}.bias`, in `groups` groups.
    pub fn load(w: &Weights<'_>, prefix: &str, groups: usize, eps: f32) -> Result<GroupNorm> {
        let weight = w.vector(&format!("{prefix}.weight"), None)?;
        let channels = weight.dims()[0] as usize;
        if groups == 0 || !channels.is_multiple_of(groups) {
            return Err(UError::invalid(format!(
                "arch-diffusion: {prefix}: {channels} channels do not split into {groups} groups"
            )));
        }
        Ok(GroupNorm {
            bias: w.vector(&format!("{prefix}.bias"), Some(channels))?,
            weight,
            groups: groups as u32,
            eps,
        })
    }

    /// Channels normalised.
    pub fn channels(&self) -> usize {
        self.weight.dims()[0] as usize
    }

    /// The normalised map.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.group_norm(&self.weight, &self.bias, self.groups, self.eps)
    }
}

/// Layer normalisation (Ba et al. 2016) of rows, with scale and shift.
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    /// `{prefix}.weight` and `{prefix}.bias` of `width` values.
    pub fn load(w: &Weights<'_>, prefix: &str, width: usize, eps: f32) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: w.vector(&format!("{prefix}.weight"), Some(width))?,
            bias: w.vector(&format!("{prefix}.bias"), Some(width))?,
            eps,
        })
    }

    /// The normalised rows.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&self.weight, &self.bias, self.eps)
    }
}

/// A layer norm without scale or shift of its own (`elementwise_affine=False`), modulated per
/// sample instead (adaLN): `LN(x) ⊙ (1 + scale) + shift`. Its row of ones serves both as the
/// norm's unit scale and as the `1` of `1 + scale`.
pub struct ModulatedNorm {
    ones: Tensor,
    zeros: Tensor,
    eps: f32,
}

impl ModulatedNorm {
    /// A norm of rows of `width`.
    pub fn new(device: &Device, width: usize, eps: f32) -> Result<ModulatedNorm> {
        let n = [width as u64];
        Ok(ModulatedNorm {
            ones: device.from_f32(&vec![1.0; width], &n)?,
            zeros: device.from_f32(&vec![0.0; width], &n)?,
            eps,
        })
    }

    /// `LN(x) ⊙ (1 + scale) + shift`, `scale` and `shift` one row each.
    pub fn forward(&self, x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
        let y = x
            .layer_norm(&self.ones, &self.zeros, self.eps)?
            .mul(&scale.add(&self.ones)?)?;
        y.add_assign(shift)?;
        Ok(y)
    }
}

/// A feature map `[c, h, w]` as rows `[h·w, c]` (one per position).
pub fn to_rows(x: &Tensor) -> Result<Tensor> {
    let &[c, h, w] = x.dims() else {
        return Err(shape_error("a feature map", x.dims(), "[c, h, w]"));
    };
    x.reshape(&[c, h * w])?.transpose()
}

/// Rows `[h·w, c]` back to a feature map `[c, h, w]`.
pub fn to_map(rows: &Tensor, (h, w): (u64, u64)) -> Result<Tensor> {
    let c = rows.dims().get(1).copied().unwrap_or_default();
    rows.transpose()?.reshape(&[c, h, w])
}

/// Height and width of a feature map.
pub fn size(x: &Tensor) -> Result<(u64, u64)> {
    match x.dims() {
        &[_, h, w] => Ok((h, w)),
        d => Err(shape_error("a feature map", d, "[c, h, w]")),
    }
}
