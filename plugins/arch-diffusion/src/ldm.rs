//! Stable Diffusion's original checkpoint layout (CompVis `ldm`), the one single-file
//! checkpoints such as `v1-5-pruned-emaonly.safetensors` are saved in: the UNet under
//! `model.diffusion_model.`, the autoencoder under `first_stage_model.`, each with its own block
//! names. [`Renamed`] gives a component stored so its diffusers names, which the blocks load by.
//!
//! The UNet's `input_blocks.k` are diffusers' down blocks flattened (block `(k−1) / (L+1)`,
//! layer `(k−1) mod (L+1)` for `L = layers_per_block`, the last layer of each the downsampler),
//! `middle_block.0..2` its mid block, `output_blocks.k` its up blocks flattened
//! (`k / (L+1)`, `k mod (L+1)`); a resnet's `in_layers`/`emb_layers`/`out_layers` are
//! `norm1`/`conv1`, `time_emb_proj`, `norm2`/`conv2`. The autoencoder's `down.i`/`up.i` are its
//! blocks (the decoder's in reverse order), `mid.block_1/2` and `mid.attn_1` its mid block,
//! whose attention projections are stored as 1×1 convolutions.

use crate::{UnetConfig, VaeConfig};
use std::collections::HashMap;
use u_sdk::{Result, UError, WeightSetBox};

/// Where a single-file checkpoint keeps its UNet.
pub const UNET_PREFIX: &str = "model.diffusion_model.";
/// Where a single-file checkpoint keeps its autoencoder (`vae.` in some later files).
pub const VAE_PREFIXES: [&str; 2] = ["first_stage_model.", "vae."];

/// A stored tensor standing for a diffusers name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Its name in the checkpoint.
    pub name: String,
    /// A 1×1 convolution's `[out, in, 1, 1]` kernel read as the linear `[out, in]` it is.
    pub squeeze: bool,
}

/// The diffusers names of a component stored in the `ldm` layout.
#[derive(Debug, Default)]
pub struct Renamed(HashMap<String, Stored>);

impl Renamed {
    /// The UNet of `weights` when they hold one under [`UNET_PREFIX`] (a single-file
    /// checkpoint); `None` for a diffusers component.
    pub fn unet(weights: &WeightSetBox, cfg: &UnetConfig) -> Result<Option<Renamed>> {
        let per_block = cfg.layers_per_block + 1;
        Self::collect(weights, &[UNET_PREFIX], |ldm| {
            unet_name(ldm, per_block).map(|name| (name, false))
        })
    }

    /// The autoencoder of `weights` when they hold one under a [`VAE_PREFIXES`] prefix; `None`
    /// for a diffusers component.
    pub fn vae(weights: &WeightSetBox, cfg: &VaeConfig) -> Result<Option<Renamed>> {
        let blocks = cfg.block_out_channels.len();
        Self::collect(weights, &VAE_PREFIXES, |ldm| vae_name(ldm, blocks))
    }

    /// The stored tensor standing for the diffusers name `name`.
    pub fn get(&self, name: &str) -> Option<&Stored> {
        self.0.get(name)
    }

    fn collect(
        weights: &WeightSetBox,
        prefixes: &[&str],
        rename: impl Fn(&str) -> Option<(String, bool)>,
    ) -> Result<Option<Renamed>> {
        let names: Vec<String> = weights
            .tensors()
            .into_result()?
            .into_iter()
            .map(|t| t.name.into_string())
            .collect();
        let Some(prefix) = prefixes
            .iter()
            .find(|p| names.iter().any(|n| n.starts_with(*p)))
        else {
            return Ok(None);
        };
        let mut renamed = HashMap::new();
        for stored in names {
            let Some((name, squeeze)) = stored.strip_prefix(prefix).and_then(&rename) else {
                continue;
            };
            if let Some(other) = renamed.insert(
                name.clone(),
                Stored {
                    name: stored,
                    squeeze,
                },
            ) {
                return Err(UError::invalid(format!(
                    "arch-diffusion: the checkpoint holds both {} and another tensor standing \
                     for {name}",
                    other.name
                )));
            }
        }
        Ok(Some(Renamed(renamed)))
    }
}

/// A resnet's inner names: `in_layers.0` is `norm1`, and so on.
fn resnet(rest: &str) -> String {
    const INNER: [(&str, &str); 6] = [
        ("in_layers.0.", "norm1."),
        ("in_layers.2.", "conv1."),
        ("emb_layers.1.", "time_emb_proj."),
        ("out_layers.0.", "norm2."),
        ("out_layers.3.", "conv2."),
        ("skip_connection.", "conv_shortcut."),
    ];
    swap(rest, &INNER)
}

/// `rest` with the first matching prefix of `table` replaced.
fn swap(rest: &str, table: &[(&str, &str)]) -> String {
    table
        .iter()
        .find_map(|(old, new)| rest.strip_prefix(old).map(|tail| format!("{new}{tail}")))
        .unwrap_or_else(|| rest.to_string())
}

/// `head.index.rest`, its index a number.
fn indexed<'a>(name: &'a str, head: &str) -> Option<(usize, &'a str)> {
    let (index, rest) = name.strip_prefix(head)?.split_once('.')?;
    Some((index.parse().ok()?, rest))
}

/// The diffusers name of the UNet tensor stored as `ldm` (its prefix removed), where
/// `per_block` is `layers_per_block + 1`; `None` for a tensor diffusers' UNet does not have.
fn unet_name(ldm: &str, per_block: usize) -> Option<String> {
    const FIXED: [(&str, &str); 5] = [
        ("time_embed.0.", "time_embedding.linear_1."),
        ("time_embed.2.", "time_embedding.linear_2."),
        ("input_blocks.0.0.", "conv_in."),
        ("out.0.", "conv_norm_out."),
        ("out.2.", "conv_out."),
    ];
    if let Some((old, new)) = FIXED.iter().find(|(old, _)| ldm.starts_with(old)) {
        return Some(format!("{new}{}", &ldm[old.len()..]));
    }
    if let Some((k, rest)) = indexed(ldm, "input_blocks.") {
        let (block, layer) = ((k.checked_sub(1)?) / per_block, (k - 1) % per_block);
        let (part, rest) = rest.split_once('.')?;
        return match (part, rest.strip_prefix("op.")) {
            ("0", Some(op)) => Some(format!("down_blocks.{block}.downsamplers.0.conv.{op}")),
            ("0", None) => Some(format!(
                "down_blocks.{block}.resnets.{layer}.{}",
                resnet(rest)
            )),
            ("1", _) => Some(format!("down_blocks.{block}.attentions.{layer}.{rest}")),
            _ => None,
        };
    }
    if let Some((k, rest)) = indexed(ldm, "middle_block.") {
        return match k {
            0 | 2 => Some(format!("mid_block.resnets.{}.{}", k / 2, resnet(rest))),
            1 => Some(format!("mid_block.attentions.0.{rest}")),
            _ => None,
        };
    }
    let (k, rest) = indexed(ldm, "output_blocks.")?;
    let (block, layer) = (k / per_block, k % per_block);
    let (part, rest) = rest.split_once('.')?;
    match part {
        "0" => Some(format!(
            "up_blocks.{block}.resnets.{layer}.{}",
            resnet(rest)
        )),
        "1" if !rest.starts_with("conv.") => {
            Some(format!("up_blocks.{block}.attentions.{layer}.{rest}"))
        }
        "1" | "2" => Some(format!("up_blocks.{block}.upsamplers.0.{rest}")),
        _ => None,
    }
}

/// The diffusers name of the autoencoder tensor stored as `ldm` (its prefix removed), for an
/// autoencoder of `blocks` blocks a side, and whether it is a 1×1 convolution read as a linear
/// layer.
fn vae_name(ldm: &str, blocks: usize) -> Option<(String, bool)> {
    const RESNET: [(&str, &str); 1] = [("nin_shortcut.", "conv_shortcut.")];
    const ATTENTION: [(&str, &str); 5] = [
        ("norm.", "group_norm."),
        ("q.", "to_q."),
        ("k.", "to_k."),
        ("v.", "to_v."),
        ("proj_out.", "to_out.0."),
    ];
    let (side, rest) = ldm.split_once('.')?;
    if !matches!(side, "encoder" | "decoder") {
        return Some((ldm.to_string(), false));
    }
    let block = |kind: &str, i: usize, rest: &str, sampler: &str| {
        let (part, tail) = rest.split_once('.')?;
        match part {
            "block" => {
                let (j, tail) = tail.split_once('.')?;
                Some(format!(
                    "{side}.{kind}_blocks.{i}.resnets.{j}.{}",
                    swap(tail, &RESNET)
                ))
            }
            p if p == sampler => Some(format!("{side}.{kind}_blocks.{i}.{sampler}rs.0.{tail}")),
            _ => None,
        }
    };
    let name = if let Some((i, rest)) = indexed(rest, "down.") {
        block("down", i, rest, "downsample")?
    } else if let Some((i, rest)) = indexed(rest, "up.") {
        block(
            "up",
            blocks.checked_sub(i.checked_add(1)?)?,
            rest,
            "upsample",
        )?
    } else if let Some(tail) = rest.strip_prefix("mid.attn_1.") {
        let name = format!("{side}.mid_block.attentions.0.{}", swap(tail, &ATTENTION));
        let squeeze = tail.ends_with("weight") && !tail.starts_with("norm.");
        return Some((name, squeeze));
    } else if let Some(tail) = rest.strip_prefix("mid.block_") {
        let (n, tail) = tail.split_once('.')?;
        let n: usize = n.parse().ok()?;
        format!(
            "{side}.mid_block.resnets.{}.{}",
            n.checked_sub(1)?,
            swap(tail, &RESNET)
        )
    } else {
        format!("{side}.{}", swap(rest, &[("norm_out.", "conv_norm_out.")]))
    };
    Some((name, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unet_blocks_flatten_as_stable_diffusion_saves_them() {
        let n = |ldm| unet_name(ldm, 3);
        assert_eq!(n("input_blocks.0.0.weight").unwrap(), "conv_in.weight");
        assert_eq!(
            n("input_blocks.4.0.in_layers.2.weight").unwrap(),
            "down_blocks.1.resnets.0.conv1.weight"
        );
        assert_eq!(
            n("input_blocks.5.1.proj_in.bias").unwrap(),
            "down_blocks.1.attentions.1.proj_in.bias"
        );
        assert_eq!(
            n("input_blocks.3.0.op.weight").unwrap(),
            "down_blocks.0.downsamplers.0.conv.weight"
        );
        assert_eq!(
            n("middle_block.2.skip_connection.bias").unwrap(),
            "mid_block.resnets.1.conv_shortcut.bias"
        );
        assert_eq!(
            n("output_blocks.5.2.conv.weight").unwrap(),
            "up_blocks.1.upsamplers.0.conv.weight"
        );
        assert_eq!(
            n("output_blocks.2.1.conv.bias").unwrap(),
            "up_blocks.0.upsamplers.0.conv.bias"
        );
        assert_eq!(
            n("output_blocks.4.1.transformer_blocks.0.attn2.to_k.weight").unwrap(),
            "up_blocks.1.attentions.1.transformer_blocks.0.attn2.to_k.weight"
        );
        assert_eq!(n("input_blocks.x.0.weight"), None);
        assert_eq!(n("input_blocks.1.7.weight"), None);
    }

    #[test]
    fn the_decoder_counts_its_blocks_from_the_other_end() {
        let n = |ldm| vae_name(ldm, 4);
        assert_eq!(
            n("decoder.up.3.block.0.nin_shortcut.weight").unwrap(),
            (
                "decoder.up_blocks.0.resnets.0.conv_shortcut.weight".into(),
                false
            )
        );
        assert_eq!(
            n("decoder.up.0.upsample.conv.bias").unwrap(),
            ("decoder.up_blocks.3.upsamplers.0.conv.bias".into(), false)
        );
        assert_eq!(
            n("encoder.down.1.downsample.conv.weight").unwrap(),
            (
                "encoder.down_blocks.1.downsamplers.0.conv.weight".into(),
                false
            )
        );
        assert_eq!(
            n("encoder.mid.attn_1.proj_out.weight").unwrap(),
            (
                "encoder.mid_block.attentions.0.to_out.0.weight".into(),
                true
            )
        );
        assert_eq!(
            n("encoder.mid.attn_1.norm.weight").unwrap(),
            (
                "encoder.mid_block.attentions.0.group_norm.weight".into(),
                false
            )
        );
        assert_eq!(
            n("decoder.mid.block_2.conv1.bias").unwrap(),
            ("decoder.mid_block.resnets.1.conv1.bias".into(), false)
        );
        assert_eq!(
            n("decoder.norm_out.weight").unwrap(),
            ("decoder.conv_norm_out.weight".into(), false)
        );
        assert_eq!(
            n("post_quant_conv.bias").unwrap(),
            ("post_quant_conv.bias".into(), false)
        );
        assert_eq!(n("decoder.up.4.block.0.conv1.weight"), None);
        assert_eq!(n("decoder.mid.block_0.conv1.weight"), None);
    }

    /// Names a malformed file may hold map to nothing (or to a name no block loads), never to
    /// a panic.
    #[test]
    fn hostile_names_are_not_a_panic() {
        let max = usize::MAX.to_string();
        for name in [
            format!("decoder.up.{max}.block.0.conv1.weight"),
            format!("encoder.mid.block_{max}.conv1.weight"),
            format!("input_blocks.{max}.0.in_layers.0.weight"),
            format!("output_blocks.{max}.1.conv.weight"),
            format!("middle_block.{max}.x"),
            "input_blocks.".into(),
            "decoder.up.-1.block.0.x".into(),
            "encoder".into(),
            String::new(),
        ] {
            let _ = unet_name(&name, 3);
            let _ = vae_name(&name, 4);
        }
    }
}
