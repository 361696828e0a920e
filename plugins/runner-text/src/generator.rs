//! A model and its tokenizer: encoding, chat prompts, and single-request generation.

use crate::{
    ChatMessage, Error, Result,
    batch::Batch,
    constraint::Grammars,
    drafter::Drafter,
    sampler,
    sequence::{Origin, Sequence, Spec},
};
use abi_stable::std_types::{ROption, RSlice, RSliceMut, RString, RVec};
use serde::Serialize;
use std::sync::OnceLock;
use u_sdk::{
    FinishReason, KvCacheBox, ModelBox, ModelConfig, ModelKind, Output, Pooling, Rows,
    SamplingParams, Segment, SeqChunk, SpecialTokens, TokenizerBox,
};

/// Prompt tokens run per forward pass during prefill.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// What one generation asks for.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate (also bounded by the model's context length).
    pub max_tokens: u32,
    /// How to pick each token.
    pub sampling: SamplingParams,
    /// Strings that end generation; they and what follows are not part of the text.
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            sampling: sampler::greedy(),
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// Speed of one generation.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Timings {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Prompt tokens per second of prefill.
    pub prompt_tokens_per_s: f64,
    /// Tokens generated.
    pub generated_tokens: u32,
    /// Generated tokens per second of the decode loop (sampling included).
    pub generated_tokens_per_s: f64,
    /// Prefill wall time, milliseconds.
    pub prompt_ms: f64,
    /// Decode loop wall time, milliseconds.
    pub generate_ms: f64,
    /// Tokens drafted by prompt lookup.
    pub draft_tokens: u32,
    /// Drafted tokens kept.
    pub accepted_tokens: u32,
}

/// The result of one generation.
#[derive(Clone, Debug, Serialize)]
pub struct Generation {
    /// Generated token ids (an end-of-sequence token that ended generation is not included).
    pub tokens: Vec<u32>,
    /// The generated text, stop string excluded.
    pub text: String,
    /// Why generation ended: `stop`, `length` or `cancelled`.
    pub finish: &'static str,
    /// Token counts and speeds.
    pub timings: Timings,
}

impl Generation {
    /// The finish reason as the ABI names it.
    pub fn finish_reason(&self) -> FinishReason {
        match self.finish {
            "stop" => FinishReason::Stop,
            "length" => FinishReason::Length,
            _ => FinishReason::Cancelled,
        }
    }
}

/// A model and its tokenizer, ready to generate.
pub struct Generator {
    model: ModelBox,
    cache: KvCacheBox,
    tokenizer: Option<TokenizerBox>,
    config: ModelConfig,
    special: SpecialTokens,
    template: Option<String>,
    prefill_chunk: usize,
    speculation: Speculation,
    drafter: Option<Drafter>,
    grammars: OnceLock<Result<Grammars>>,
}

/// Prompt-lookup speculative decoding's settings (see [`crate::lookup`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation {
    /// Most tokens drafted per pass (0: off).
    pub draft_tokens: usize,
    /// Drafts run only while a pass carries at most this many decoding requests.
    pub max_running: usize,
}

impl Default for Speculation {
    fn default() -> Self {
        Speculation {
            draft_tokens: 4,
            max_running: 4,
        }
    }
}

impl Generator {
    /// Wires a built decoder and, for text in and out, its tokenizer; asks each once what it
    /// is (hyper-parameters, cache, special tokens, chat template).
    pub fn new(model: ModelBox, tokenizer: Option<TokenizerBox>) -> Result<Self> {
        let config = model
            .config()
            .into_result()
            .map_err(|e| Error::plugin("model.config", e))?;
        // A cross-decoder (IDEFICS) generates text too, its context the engine's images.
        let decodes = matches!(config.kind, ModelKind::Decoder | ModelKind::CrossDecoder);
        if !decodes || config.vocab_size == 0 {
            return Err(Error::InvalidRequest(format!(
                "text generation needs a decoder with a vocabulary; `{}` is a {:?} model",
                config.family, config.kind
            )));
        }
        let cache = model
            .cache()
            .into_result()
            .map_err(|e| Error::plugin("model.cache", e))?
            .into_option()
            .ok_or_else(|| {
                Error::InvalidRequest(format!("the `{}` model keeps no KV cache", config.family))
            })?;
        let (special, template) = match &tokenizer {
            Some(tok) => (
                tok.special_tokens()
                    .into_result()
                    .map_err(|e| Error::plugin("tokenizer.special_tokens", e))?,
                tok.chat_template()
                    .into_result()
                    .map_err(|e| Error::plugin("tokenizer.chat_template", e))?
                    .into_option()
                    .map(RString::into_string),
            ),
            None => (
                SpecialTokens {
                    bos: ROption::RNone,
                    eos: RVec::new(),
                    add_bos: false,
                    pad: ROption::RNone,
                },
                None,
            ),
        };
        Ok(Self {
            model,
            cache,
            tokenizer,
            config,
            special,
            template,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            speculation: Speculation::default(),
            drafter: None,
            grammars: OnceLock::new(),
        })
    }

    /// Sets how many prompt tokens one prefill pass runs (at least 1).
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens.max(1);
        self
    }

    /// Sets prompt-lookup speculative decoding.
    pub fn with_speculation(mut self, speculation: Speculation) -> Self {
        self.speculation = speculation;
        self
    }

    /// Drafts with `draft` (a decoder of this model's vocabulary) instead of by prompt lookup,
    /// when given (see [`crate::drafter`]); the speculation settings apply to its drafts.
    pub fn with_draft_model(mut self, draft: Option<ModelBox>) -> Result<Self> {
        self.drafter = match draft {
            Some(model) => Some(Drafter::new(model, self.config.vocab_size)?),
            None => None,
        };
        Ok(self)
    }

    /// Speculative decoding's settings.
    pub fn speculation(&self) -> Speculation {
        self.speculation
    }

    /// The draft model, when speculation drafts with one.
    pub(crate) fn drafter(&self) -> Option<&Drafter> {
        self.drafter.as_ref()
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The tokenizer, if one was wired.
    pub fn tokenizer(&self) -> Option<&TokenizerBox> {
        self.tokenizer.as_ref()
    }

    /// The built model.
    pub(crate) fn model(&self) -> &ModelBox {
        &self.model
    }

    /// The cache the model's KV lives in.
    pub(crate) fn cache(&self) -> &KvCacheBox {
        &self.cache
    }

    /// The tokenizer's special tokens (none without a tokenizer).
    pub(crate) fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// The compiler of this model's structured-output constraints, its token trie built on
    /// the first call.
    pub(crate) fn grammars(&self) -> Result<&Grammars> {
        self.grammars
            .get_or_init(|| Grammars::new(self))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The raw bytes of token `id` (empty without a tokenizer).
    pub(crate) fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        match &self.tokenizer {
            Some(tok) => Ok(tok
                .token_bytes(id)
                .into_result()
                .map_err(|e| Error::plugin("tokenizer.token_bytes", e))?
                .into_vec()),
            None => Ok(Vec::new()),
        }
    }

    /// Encodes text that continues a sequence: no BOS or other special tokens are added.
    pub(crate) fn encode_continuation(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .tok()?
            .encode(text.into(), false, true)
            .into_result()
            .map_err(|e| Error::plugin("tokenizer.encode", e))?
            .into_vec())
    }

    fn tok(&self) -> Result<&TokenizerBox> {
        self.tokenizer.as_ref().ok_or(Error::NoTokenizer)
    }

    /// Encodes a prompt with the special tokens the tokenizer adds (BOS where the model wants
    /// one); a BOS that the text already starts with (from a chat template) is not doubled.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let tok = self.tok()?;
        let mut ids = tok
            .encode(text.into(), true, true)
            .into_result()
            .map_err(|e| Error::plugin("tokenizer.encode", e))?
            .into_vec();
        if let ROption::RSome(bos) = self.special.bos
            && ids.len() >= 2
            && ids[0] == bos
            && ids[1] == bos
        {
            ids.remove(0);
        }
        Ok(ids)
    }

    fn token_text(&self, id: Option<u32>) -> String {
        let (Some(tok), Some(id)) = (self.tokenizer.as_ref(), id) else {
            return String::new();
        };
        tok.token_bytes(id)
            .into_result()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The model's pooled final hidden state over `tokens` (its own pooling), computed in a
    /// scratch sequence of the cache that is released afterwards, `prefill_chunk` rows a pass.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let hidden = self.config.hidden as usize;
        let plugin = |op| move |e| Error::plugin(op, e);
        let seq = self
            .cache
            .create()
            .into_result()
            .map_err(plugin("cache.create"))?;
        let mut rows = Vec::with_capacity(tokens.len().min(self.prefill_chunk) * hidden);
        let mut sum = vec![0f64; hidden];
        let (mut first, mut last) = (Vec::new(), Vec::new());
        let mut result = Ok(());
        for chunk in tokens.chunks(self.prefill_chunk) {
            let input = [Segment::Tokens(RSlice::from_slice(chunk))];
            let output = Output::Hidden {
                layer: self.config.layers,
                rows: Rows::All,
            };
            rows.resize(chunk.len() * hidden, 0.0);
            result = self
                .model
                .forward(
                    RSlice::from_slice(&[SeqChunk::tokens(seq, &input, output)]),
                    RSliceMut::from_mut_slice(&mut rows),
                )
                .into_result()
                .map_err(plugin("model.forward"));
            if result.is_err() {
                break;
            }
            for row in rows.chunks_exact(hidden) {
                sum.iter_mut()
                    .zip(row)
                    .for_each(|(s, &v)| *s += f64::from(v));
            }
            if first.is_empty() {
                first = rows[..hidden].to_vec();
            }
            last = rows[rows.len() - hidden..].to_vec();
        }
        let released = self
            .cache
            .release(seq)
            .into_result()
            .map_err(plugin("cache.release"));
        result?;
        released?;
        Ok(match self.config.pooling {
            Pooling::Mean => sum
                .iter()
                .map(|s| (s / tokens.len().max(1) as f64) as f32)
                .collect(),
            Pooling::First => first,
            Pooling::Last => last,
            Pooling::Head => {
                return Err(Error::InvalidRequest(format!(
                    "the `{}` model pools with a head, which a decoder's embeddings do not use",
                    self.config.family
                )));
            }
        })
    }

    /// Renders `messages` with the model's chat template, ready for the assistant's turn.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_chat(messages, &[], true)
    }

    /// Renders `messages` (and declared `tools`, OpenAI's shape) with the chat template, with
    /// or without the assistant's opening (see [`u_chat_template::render_chat`]).
    pub(crate) fn render_chat(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.tok()?;
        let Some(template) = &self.template else {
            return Err(Error::NoChatTemplate);
        };
        let bos = self.token_text(self.special.bos.into_option());
        let eos = self.token_text(self.special.eos.first().copied());
        Ok(u_chat_template::render_chat(
            template,
            messages,
            tools,
            add_generation_prompt,
            &bos,
            &eos,
        )?)
    }

    /// Generates from prompt text; see [`Generator::generate_tokens`].
    pub fn generate(
        &self,
        prompt: &str,
        options: &GenerateOptions,
        on_piece: &mut dyn FnMut(Option<u32>, &str) -> bool,
    ) -> Result<Generation> {
        let ids = self.encode(prompt)?;
        self.generate_tokens(&ids, options, on_piece)
    }

    /// Runs `prompt` and generates up to `options.max_tokens` tokens. `on_piece` is called for
    /// every generated token with its id and the text it completes (empty while a UTF-8
    /// character or a possible stop string is incomplete), and once with `None` for text held
    /// back until the end; it returns `false` to cancel.
    ///
    /// This drives the same per-request state machine and batch step as the scheduler behind
    /// [`crate::EngineHandle`], with one request and a fresh cache sequence (nothing is shared
    /// with the prefix cache).
    pub fn generate_tokens(
        &self,
        prompt: &[u32],
        options: &GenerateOptions,
        on_piece: &mut dyn FnMut(Option<u32>, &str) -> bool,
    ) -> Result<Generation> {
        let seq = Sequence::admit(
            self,
            Spec {
                prompt: prompt.to_vec(),
                origin: Origin::Fresh,
                options: options.clone(),
                breakpoints: Vec::new(),
                top_logprobs: None,
                save_as: None,
                logit_bias: Vec::new(),
                guide: None,
                prefix: crate::owner::PrefixKey::Off,
                adapters: Vec::new(),
                steer: Default::default(),
                soft_prompt: None,
                images: Vec::new(),
                context: None,
            },
        )?;
        let mut batch = Batch::new(self.prefill_chunk);
        batch.push(seq, ());
        let mut text = String::new();
        loop {
            batch.step(self)?;
            for (seq, ()) in batch.slots_mut() {
                for piece in seq.take_pieces() {
                    text.push_str(&piece.text);
                    if !on_piece(piece.id, &piece.text) && piece.id.is_some() {
                        seq.cancel();
                    }
                }
            }
            if let Some((seq, ())) = batch.take_done().pop() {
                let out = seq.close()?;
                let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
                return Ok(Generation {
                    timings: Timings {
                        prompt_tokens: out.prompt_tokens as u32,
                        prompt_tokens_per_s: rate(out.prompt_tokens, out.prompt_s),
                        generated_tokens: out.tokens.len() as u32,
                        generated_tokens_per_s: rate(out.tokens.len(), out.decode_s),
                        prompt_ms: out.prompt_s * 1e3,
                        generate_ms: out.decode_s * 1e3,
                        draft_tokens: out.drafted as u32,
                        accepted_tokens: out.accepted as u32,
                    },
                    tokens: out.tokens,
                    text,
                    finish: match out.finish {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                        FinishReason::Cancelled => "cancelled",
                    },
                });
            }
        }
    }
}
