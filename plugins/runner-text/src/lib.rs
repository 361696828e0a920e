//! # u-runner-text — the text-generation runner plugin
//!
//! A `runner` plugin: the host hands it a model an architecture plugin built (with a backend
//! and a KV cache) and the tokenizer, and it serves them to transports as an
//! [`u_sdk::Engine`] ([`TextRunner`]). Scheduling, sampling, chat templates (minijinja, through
//! [`u_chat_template`]) and prompt caching run here, inside a sandboxed plugin, not in the host.
//! It holds no model math; everything numeric happens behind [`u_sdk::Model::forward`].
//!
//! - [`Generator`]: tokenize (BOS as the tokenizer says), prefill in chunks, the decode loop,
//!   streamed text (whole UTF-8 characters, from each token's raw bytes), end-of-sequence ids,
//!   stop strings, `max_tokens`, timings.
//! - [`sampler`]: greedy, temperature, top-k, top-p, min-p and penalties, seeded and reproducible.
//! - structured outputs: a request's `constraint` (JSON Schema, regex, Lark grammar) compiled by
//!   llguidance over a token trie built once per model; the mask of what the grammar allows is
//!   computed while the batch's forward pass runs and applied before sampling, and generation
//!   ends when the grammar is complete.
//! - chat templates: the model's template rendered by [`u_chat_template`] (as transformers does).
//! - [`EngineHandle`]: a [`Generator`] as the ABI's [`u_sdk::Engine`], for transports: a
//!   scheduler thread batches every running request into shared forward passes (continuous
//!   batching, chunked prefill, a bounded queue that answers `Busy`), reuses cached prompt
//!   prefixes and cache breakpoints, reports logprobs, and saves, resumes, forks and grafts KV
//!   checkpoints. A request's chat `messages` are rendered here with the model's template.
//!   [`Limits`] sizes the batch, the queue and the tokens per pass.
//!
//! Inside, one request is one `sequence` state machine (prefix lookup, prefill, sampling,
//! streaming, stop conditions, what is cached at the end), and one `batch` step runs a forward
//! pass over many of them; [`Generator::generate`] drives the same two with a single request.
#![deny(missing_docs)]
// `#[sabi_trait]` impls expand inside const blocks, which this lint flags.
#![allow(non_local_definitions)]

mod batch;
mod constraint;
mod drafter;
pub mod extras;
pub mod fork;
mod generator;
mod handle;
mod images;
mod ledger;
mod logprobs;
mod lookup;
pub mod owner;
mod prompt;
mod runner;
pub mod sampler;
mod scheduler;
mod sequence;
pub mod stream;

pub use generator::{
    DEFAULT_PREFILL_CHUNK, GenerateOptions, Generation, Generator, Speculation, Timings,
};
pub use handle::EngineHandle;
pub use images::ImageSettings;
pub use logprobs::MAX_TOP_LOGPROBS;
pub use runner::TextRunner;
pub use sampler::Sampler;
pub use scheduler::Limits;
pub use u_chat_template::ChatMessage;

use u_sdk::{ErrorKind, UError};

/// What can go wrong while generating.
#[derive(Clone, Debug, thiserror::Error)]
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
    #[error(transparent)]
    Template(#[from] u_chat_template::TemplateError),
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
    /// A malformed request (bad cache breakpoint, too many logprobs, nothing to save…).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Every running slot and queue place is taken.
    #[error(
        "the engine is at capacity ({running} running and {queued} queued requests); retry later"
    )]
    Busy {
        /// Most requests running at once.
        running: usize,
        /// Most requests waiting.
        queued: usize,
    },
    /// Something a request names is not there (an adapter that is not loaded).
    #[error("{0}")]
    NotFound(String),
    /// Something this model or engine cannot do (e.g. `suffix` without FIM tokens).
    #[error("{0}")]
    Unsupported(String),
    /// A prompt plus the `max_tokens` a client asked for does not fit in the context.
    #[error(
        "This model's maximum context length is {context} tokens. However, you requested \
         {} tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce \
         the length of the messages or completion.",
        prompt + max_tokens
    )]
    ContextExceeded {
        /// Prompt tokens.
        prompt: usize,
        /// The completion tokens asked for.
        max_tokens: usize,
        /// Context length.
        context: usize,
    },
    /// The scheduler thread is gone (shut down, or it could not start).
    #[error("the engine's scheduler is not running")]
    Stopped,
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
            Error::NoTokenizer | Error::NoChatTemplate | Error::Unsupported(_) => {
                ErrorKind::Unsupported
            }
            Error::ContextFull { .. } => ErrorKind::ResourceExhausted,
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::Busy { .. } => ErrorKind::Busy,
            Error::Stopped => ErrorKind::Internal,
            _ => ErrorKind::InvalidInput,
        };
        UError::new(kind, self.to_string())
    }
}

/// The engine's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for UError {
    fn from(e: Error) -> Self {
        e.to_uerror()
    }
}
