//! # u-engine — text generation over SDK interfaces
//!
//! The host links this library to turn plugins into a text generator: a weight set from a
//! loader, a model an architecture plugin built from it (with a kernels plugin and a KV cache),
//! and a tokenizer from the tokenizer plugin. It holds no model math; everything numeric happens
//! behind [`u_sdk::Model::forward`].
//!
//! - [`Generator`]: tokenize (BOS as the tokenizer says), prefill in chunks, the decode loop,
//!   streamed text (whole UTF-8 characters, from each token's raw bytes), end-of-sequence ids,
//!   stop strings, `max_tokens`, timings.
//! - [`sampler`]: greedy, temperature, top-k, top-p, min-p and penalties, seeded and reproducible.
//! - [`chat`]: the model's chat template rendered with `minijinja`.
//! - [`EngineHandle`]: a [`Generator`] as the ABI's [`u_sdk::Engine`], for transports; a
//!   request's chat `messages` are rendered here with the model's template.
#![deny(missing_docs)]
// `#[sabi_trait]` impls expand inside const blocks, which this lint flags.
#![allow(non_local_definitions)]

pub mod chat;
mod generator;
pub mod sampler;
pub mod stream;

pub use chat::ChatMessage;
pub use generator::{DEFAULT_PREFILL_CHUNK, GenerateOptions, Generation, Generator, Timings};
pub use sampler::Sampler;

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{ROption, RResult, RSlice, RStr, RString, RVec},
};
use std::sync::Arc;
use u_sdk::{
    CheckpointInfo, CheckpointRequest, Engine, Engine_TO, EngineBox, EngineStats, ErrorKind,
    GenerateRequest, GenerateSummary, GeneratedToken, TokenSinkBox, UError,
};

/// What can go wrong while generating.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A plugin call failed.
    #[error("{op}: {source}")]
    Plugin {
        /// The interface call, e.g. `model.forward`.
        op: &'static str,
        /// The plugin's error.
        source: UError,
    },
    /// Text in or out was asked for but no tokenizer was wired.
    #[error("no tokenizer: the model has no tokenizer metadata and none was given")]
    NoTokenizer,
    /// `--chat` on a model without a chat template.
    #[error("the model ships no chat template")]
    NoChatTemplate,
    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    Template(String),
    /// The prompt has no tokens.
    #[error("the prompt is empty (no tokens)")]
    EmptyPrompt,
    /// A prompt token id past the vocabulary.
    #[error("token id {id} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: u32,
    },
    /// The prompt fills the context.
    #[error("the prompt has {prompt} tokens; the model's context holds {context}")]
    ContextFull {
        /// Prompt tokens.
        prompt: usize,
        /// Context length.
        context: usize,
    },
}

impl Error {
    fn plugin(op: &'static str, source: UError) -> Self {
        Error::Plugin { op, source }
    }

    /// The error as it crosses the ABI.
    pub fn to_uerror(&self) -> UError {
        let kind = match self {
            Error::Plugin { source, .. } => source.kind,
            Error::NoTokenizer | Error::NoChatTemplate => ErrorKind::Unsupported,
            Error::ContextFull { .. } => ErrorKind::ResourceExhausted,
            _ => ErrorKind::InvalidInput,
        };
        UError::new(kind, self.to_string())
    }
}

/// The engine's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// A shared [`Generator`] serving one model name through the ABI's [`Engine`] interface.
#[derive(Clone)]
pub struct EngineHandle {
    name: String,
    generator: Arc<Generator>,
}

impl EngineHandle {
    /// Serves `generator` under the model name `name`.
    pub fn new(name: impl Into<String>, generator: Arc<Generator>) -> Self {
        Self {
            name: name.into(),
            generator,
        }
    }

    /// As an ABI object for transports.
    pub fn into_box(self) -> EngineBox {
        Engine_TO::from_value(self, TD_Opaque)
    }
}

impl Engine for EngineHandle {
    fn models(&self) -> RVec<RString> {
        RVec::from(vec![RString::from(self.name.as_str())])
    }

    fn generate(
        &self,
        request: &GenerateRequest,
        mut sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError> {
        u_sdk::guard("engine.generate", || {
            if request.model.as_str() != self.name {
                return Err(UError::not_found(format!(
                    "model `{}` is not served (this engine serves `{}`)",
                    request.model, self.name
                )));
            }
            let options = GenerateOptions {
                max_tokens: request.max_tokens,
                sampling: request.sampling.clone(),
                stop: request.stop.iter().map(|s| s.to_string()).collect(),
                ignore_eos: false,
            };
            let chat;
            let prompt = if request.messages.is_empty() {
                request.prompt.as_str()
            } else {
                let messages: Vec<ChatMessage> = request
                    .messages
                    .iter()
                    .map(|m| ChatMessage::new(m.role.as_str(), m.content.as_str()))
                    .collect();
                chat = self
                    .generator
                    .chat_prompt(&messages)
                    .map_err(|e| e.to_uerror())?;
                chat.as_str()
            };
            let mut last = 0;
            let out = self
                .generator
                .generate(prompt, &options, &mut |id, text| {
                    last = id.unwrap_or(last);
                    sink.token(&GeneratedToken {
                        id: last,
                        text: text.into(),
                        logprob: ROption::RNone,
                        top_logprobs: RSlice::EMPTY,
                    })
                })
                .map_err(|e| e.to_uerror())?;
            Ok(GenerateSummary {
                prompt_tokens: out.timings.prompt_tokens,
                cached_tokens: 0,
                cache_written_tokens: 0,
                generated_tokens: out.timings.generated_tokens,
                finish: out.finish_reason(),
                stop_sequence: ROption::RNone,
            })
        })
    }

    fn stats(&self) -> EngineStats {
        EngineStats::default()
    }

    fn checkpoint(&self, _request: &CheckpointRequest) -> RResult<RVec<CheckpointInfo>, UError> {
        RResult::RErr(UError::unsupported(
            "checkpoints are not wired into the engine yet",
        ))
    }

    fn embed(&self, _model: RStr<'_>, _input: RStr<'_>) -> RResult<RVec<f32>, UError> {
        RResult::RErr(UError::unsupported(
            "embeddings are not wired into the engine yet",
        ))
    }
}
