//! The decode loop: tokenize, prefill in chunks, sample, stream text, stop.

use crate::{
    Error, Result,
    chat::{self, ChatMessage},
    sampler::{self, Sampler},
    stream::{StopCheck, StopMatcher, Utf8Stream},
};
use abi_stable::std_types::{ROption, RSlice, RSliceMut};
use serde::Serialize;
use std::{collections::HashSet, time::Instant};
use u_sdk::{
    FinishReason, LogitsWanted, ModelBox, ModelConfig, SamplingParams, SeqChunk, SeqId,
    TokenizerBox,
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
    tokenizer: Option<TokenizerBox>,
    config: ModelConfig,
    prefill_chunk: usize,
}

impl Generator {
    /// Wires a built model and, for text in and out, its tokenizer.
    pub fn new(model: ModelBox, tokenizer: Option<TokenizerBox>) -> Self {
        let config = model.config();
        Self {
            model,
            tokenizer,
            config,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }

    /// Sets how many prompt tokens one prefill pass runs (at least 1).
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens.max(1);
        self
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The tokenizer, if one was wired.
    pub fn tokenizer(&self) -> Option<&TokenizerBox> {
        self.tokenizer.as_ref()
    }

    fn tok(&self) -> Result<&TokenizerBox> {
        self.tokenizer.as_ref().ok_or(Error::NoTokenizer)
    }

    /// Encodes a prompt with the special tokens the tokenizer adds (BOS where the model wants
    /// one); a BOS that the text already starts with (from a chat template) is not doubled.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let tok = self.tok()?;
        let mut ids = tok
            .encode(text.into(), true)
            .into_result()
            .map_err(|e| Error::plugin("tokenizer.encode", e))?
            .into_vec();
        if let ROption::RSome(bos) = tok.special_tokens().bos
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

    /// Renders `messages` with the model's chat template, ready for the assistant's turn.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String> {
        let tok = self.tok()?;
        let ROption::RSome(template) = tok.chat_template() else {
            return Err(Error::NoChatTemplate);
        };
        let special = tok.special_tokens();
        let bos = self.token_text(special.bos.into_option());
        let eos = self.token_text(special.eos.first().copied());
        chat::render(&template, messages, true, &bos, &eos).map_err(Error::Template)
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
    pub fn generate_tokens(
        &self,
        prompt: &[u32],
        options: &GenerateOptions,
        on_piece: &mut dyn FnMut(Option<u32>, &str) -> bool,
    ) -> Result<Generation> {
        let vocab = self.config.vocab_size;
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t >= vocab) {
            return Err(Error::TokenOutOfRange { id: bad, vocab });
        }
        let context = match self.config.context_length {
            0 => usize::MAX,
            n => n as usize,
        };
        if prompt.len() >= context {
            return Err(Error::ContextFull {
                prompt: prompt.len(),
                context,
            });
        }
        let budget = (options.max_tokens as usize).min(context - prompt.len());
        let cache = self.model.cache();
        let seq = cache
            .create()
            .into_result()
            .map_err(|e| Error::plugin("cache.create", e))?;
        let result = self.run(seq, prompt, budget, options, on_piece);
        // Releasing can only fail for an unknown sequence; the result matters more.
        let _ = cache.release(seq);
        result
    }

    fn forward(
        &self,
        seq: SeqId,
        tokens: &[u32],
        logits: LogitsWanted,
        out: &mut [f32],
    ) -> Result<()> {
        let chunk = [SeqChunk {
            seq,
            tokens: RSlice::from_slice(tokens),
            logits,
        }];
        self.model
            .forward(RSlice::from_slice(&chunk), RSliceMut::from_mut_slice(out))
            .into_result()
            .map_err(|e| Error::plugin("model.forward", e))
    }

    fn run(
        &self,
        seq: SeqId,
        prompt: &[u32],
        budget: usize,
        options: &GenerateOptions,
        on_piece: &mut dyn FnMut(Option<u32>, &str) -> bool,
    ) -> Result<Generation> {
        let mut logits = vec![0f32; self.config.vocab_size as usize];
        let start = Instant::now();
        let chunks = prompt.len().div_ceil(self.prefill_chunk);
        for (i, chunk) in prompt.chunks(self.prefill_chunk).enumerate() {
            if i + 1 == chunks {
                self.forward(seq, chunk, LogitsWanted::Last, &mut logits)?;
            } else {
                self.forward(seq, chunk, LogitsWanted::None, &mut [])?;
            }
        }
        let prompt_s = start.elapsed().as_secs_f64();

        let eos: HashSet<u32> = match (&self.tokenizer, options.ignore_eos) {
            (Some(tok), false) => tok.special_tokens().eos.into_iter().collect(),
            _ => HashSet::new(),
        };
        let mut sampler = Sampler::new(&options.sampling);
        let mut history = prompt.to_vec();
        let mut tokens = Vec::new();
        let mut text = String::new();
        let mut utf8 = Utf8Stream::default();
        let mut stops = StopMatcher::new(options.stop.iter().cloned());
        let decode_start = Instant::now();
        let finish = loop {
            if tokens.len() >= budget {
                break "length";
            }
            let id = sampler.sample(&mut logits, &history);
            if eos.contains(&id) {
                break "stop";
            }
            tokens.push(id);
            history.push(id);
            let bytes = match &self.tokenizer {
                Some(tok) => tok
                    .token_bytes(id)
                    .into_result()
                    .map_err(|e| Error::plugin("tokenizer.token_bytes", e))?
                    .into_vec(),
                None => Vec::new(),
            };
            match stops.push(&utf8.push(&bytes)) {
                StopCheck::Emit(piece) => {
                    text.push_str(&piece);
                    if !on_piece(Some(id), &piece) {
                        break "cancelled";
                    }
                }
                StopCheck::Stop(piece) => {
                    text.push_str(&piece);
                    on_piece(Some(id), &piece);
                    return Ok(self.finish(prompt, tokens, text, "stop", prompt_s, decode_start));
                }
            }
            if tokens.len() >= budget {
                break "length";
            }
            self.forward(seq, &[id], LogitsWanted::Last, &mut logits)?;
        };
        if finish != "cancelled" {
            let mut tail = match stops.push(&utf8.finish()) {
                StopCheck::Emit(s) | StopCheck::Stop(s) => s,
            };
            tail.push_str(&stops.finish());
            if !tail.is_empty() {
                text.push_str(&tail);
                on_piece(None, &tail);
            }
        }
        Ok(self.finish(prompt, tokens, text, finish, prompt_s, decode_start))
    }

    fn finish(
        &self,
        prompt: &[u32],
        tokens: Vec<u32>,
        text: String,
        finish: &'static str,
        prompt_s: f64,
        decode_start: Instant,
    ) -> Generation {
        let decode_s = decode_start.elapsed().as_secs_f64();
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        Generation {
            timings: Timings {
                prompt_tokens: prompt.len() as u32,
                prompt_tokens_per_s: rate(prompt.len(), prompt_s),
                generated_tokens: tokens.len() as u32,
                generated_tokens_per_s: rate(tokens.len(), decode_s),
                prompt_ms: prompt_s * 1e3,
                generate_ms: decode_s * 1e3,
            },
            tokens,
            text,
            finish,
        }
    }
}
