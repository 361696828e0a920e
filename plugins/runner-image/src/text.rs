//! A pipeline's text side: its tokenizers and text encoders, and how a prompt becomes what the
//! denoiser reads — as diffusers' pipelines encode prompts:
//!
//! ```text
//! Stable Diffusion 1, 2:  rows = clip(prompt).last_hidden_state                  [77, w]
//! Stable Diffusion 3:     rows = [clip_l.hidden_states[-2] ‖ clip_g.hidden_states[-2] ‖ 0…]
//!                                ++ t5(prompt).last_hidden_state (zeros without a T5)
//!                         pooled = clip_l.text_embeds ‖ clip_g.text_embeds
//! FLUX:                   rows = t5(prompt).last_hidden_state                    [512, w]
//!                         pooled = clip(prompt).pooler_output
//! ```

use crate::pipeline::forward;
use abi_stable::std_types::RSlice;
use u_sdk::{ModelBox, Output, Pooling, Rows, Segment, SeqChunk, TokenizerBox, UError};

fn invalid(why: String) -> UError {
    UError::invalid(format!("runner-image: {why}"))
}

/// What a prompt becomes: the rows the denoiser cross-attends to and, for a denoiser that
/// reads one (Stable Diffusion 3), a pooled vector after its timestep (empty for the rest).
#[derive(Clone, Debug, PartialEq)]
pub struct Embedded {
    /// `[positions, width]`, row-major.
    pub rows: Vec<f32>,
    /// The pooled text, or empty.
    pub pooled: Vec<f32>,
}

/// One text encoder with its tokenizer.
pub struct TextEncoder {
    model: ModelBox,
    tokenizer: TokenizerBox,
    /// Its blocks (`Output::Hidden` takes `0..=layers`).
    layers: u32,
    /// Width of a row.
    width: usize,
    /// Positions every prompt is padded or cut to (CLIP's 77; T5's 256 in Stable Diffusion 3).
    positions: usize,
    /// The id prompts are padded with.
    pad: Option<u32>,
}

impl TextEncoder {
    /// `model` with `tokenizer`, prompts padded or cut to `positions` (the model's context
    /// length when `None`).
    pub fn new(
        model: ModelBox,
        tokenizer: TokenizerBox,
        positions: Option<usize>,
    ) -> u_sdk::Result<TextEncoder> {
        let config = model.config().into_result()?;
        let positions = positions.unwrap_or(config.context_length as usize);
        // A context length of 0: the encoder fixes none (an exported graph).
        let length = config.context_length as usize;
        if positions < 2 || (length != 0 && length < positions) {
            return Err(invalid(format!(
                "a text encoder of {} positions cannot read prompts of {positions}",
                config.context_length
            )));
        }
        Ok(TextEncoder {
            pad: tokenizer.special_tokens().into_result()?.pad.into_option(),
            model,
            tokenizer,
            layers: config.layers,
            width: config.hidden as usize,
            positions,
        })
    }

    /// Width of its rows.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Positions its prompts are padded or cut to.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// The token ids of `prompt` as the pipeline feeds them to the encoder: with its special
    /// tokens, cut to the encoder's positions (keeping the end token), padded to them.
    pub fn tokens(&self, prompt: &str) -> u_sdk::Result<Vec<u32>> {
        let mut ids = self
            .tokenizer
            .encode(prompt.into(), true, false)
            .into_result()?
            .into_vec();
        let n = self.positions;
        let last = *ids
            .last()
            .ok_or_else(|| invalid("the tokenizer gave no ids".into()))?;
        if ids.len() > n {
            ids.truncate(n - 1);
            ids.push(last);
        }
        ids.resize(n, self.pad.unwrap_or(last));
        Ok(ids)
    }

    /// The rows of `prompt` after `blocks` blocks (all of them: the final, normed rows),
    /// `[positions, width]`.
    pub fn rows(&self, prompt: &str, blocks: u32) -> u_sdk::Result<Vec<f32>> {
        self.output(
            prompt,
            Output::Hidden {
                layer: blocks,
                rows: Rows::All,
            },
            self.positions * self.width,
        )
    }

    /// The pooled vector of `prompt` (CLIP's: the end-of-text row, projected).
    pub fn pooled(&self, prompt: &str) -> u_sdk::Result<Vec<f32>> {
        self.output(prompt, Output::Pooled(Pooling::Head), self.width)
    }

    fn output(&self, prompt: &str, output: Output, floats: usize) -> u_sdk::Result<Vec<f32>> {
        let ids = self.tokens(prompt)?;
        let input = [Segment::Tokens(RSlice::from_slice(&ids))];
        forward(&self.model, &[SeqChunk::tokens(0, &input, output)], floats)
    }
}

/// How a pipeline turns prompts into conditions.
pub enum Prompting {
    /// One CLIP text encoder's final rows (Stable Diffusion 1 and 2).
    Clip(TextEncoder),
    /// FLUX's: T5's rows, and the CLIP's pooled row (`CLIPTextModel`'s `pooler_output`).
    Flux {
        /// The CLIP text encoder (its pooled row only).
        clip: TextEncoder,
        /// The T5 encoder (its final rows).
        t5: TextEncoder,
    },
    /// Stable Diffusion 3's two CLIPs and T5.
    Sd3 {
        /// CLIP-L and CLIP-G (each a `CLIPTextModelWithProjection`).
        clips: Box<[TextEncoder; 2]>,
        /// The T5 encoder; without one its rows are zeros, as diffusers makes them.
        t5: Option<TextEncoder>,
        /// Width of a context row (the transformer's `joint_attention_dim`).
        joint: usize,
        /// T5's positions (diffusers' `max_sequence_length`, 256).
        t5_positions: usize,
    },
}

impl Prompting {
    /// The encoder whose tokens stand for the pipeline's (the first).
    pub fn first(&self) -> &TextEncoder {
        match self {
            Prompting::Clip(e) => e,
            Prompting::Sd3 { clips, .. } => &clips[0],
            Prompting::Flux { clip, .. } => clip,
        }
    }

    /// What `prompt` conditions the denoiser on.
    pub fn embed(&self, prompt: &str) -> u_sdk::Result<Embedded> {
        match self {
            Prompting::Clip(e) => Ok(Embedded {
                rows: e.rows(prompt, e.layers)?,
                pooled: Vec::new(),
            }),
            Prompting::Flux { clip, t5 } => Ok(Embedded {
                rows: t5.rows(prompt, t5.layers)?,
                pooled: clip.pooled(prompt)?,
            }),
            Prompting::Sd3 {
                clips,
                t5,
                joint,
                t5_positions,
            } => {
                let [l, g] = &**clips;
                let penultimate = |e: &TextEncoder| e.rows(prompt, e.layers - 1);
                let (rows_l, rows_g) = (penultimate(l)?, penultimate(g)?);
                let mut rows = vec![0f32; (l.positions + t5_positions) * joint];
                for (p, row) in rows.chunks_exact_mut(*joint).take(l.positions).enumerate() {
                    row[..l.width].copy_from_slice(&rows_l[p * l.width..(p + 1) * l.width]);
                    row[l.width..l.width + g.width]
                        .copy_from_slice(&rows_g[p * g.width..(p + 1) * g.width]);
                }
                if let Some(t5) = t5 {
                    rows[l.positions * joint..].copy_from_slice(&t5.rows(prompt, t5.layers)?);
                }
                let mut pooled = l.pooled(prompt)?;
                pooled.extend(g.pooled(prompt)?);
                Ok(Embedded { rows, pooled })
            }
        }
    }
}
