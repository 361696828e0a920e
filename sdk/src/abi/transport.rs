//! Transport plugins: carry requests from clients to the engine the host wires up.
//!
//! A transport never opens sockets itself: the host creates the listeners the deployment grants
//! (`net.listen`) before the process is locked down, and passes their file descriptors in the
//! [`TransportContext`].

use crate::abi::error::UError;
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, ROption, RResult, RStr, RString, RVec},
};

/// A listening socket the host opened for the transport.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct Listener {
    /// The address as granted, e.g. `unix:/run/u.sock` or `tcp:127.0.0.1:8080`.
    pub address: RString,
    /// The listening socket's file descriptor (owned by the transport from now on).
    pub fd: i32,
}

/// Sampling settings of one request.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass (1.0 = off).
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: u32,
    /// Drop tokens below `min_p` × the top probability (0 = off).
    pub min_p: f32,
    /// Repetition penalty (1.0 = off).
    pub repetition_penalty: f32,
    /// Presence penalty (0 = off).
    pub presence_penalty: f32,
    /// Frequency penalty (0 = off).
    pub frequency_penalty: f32,
    /// Seed for reproducible sampling.
    pub seed: ROption<u64>,
}

/// One message of a chat conversation.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct ChatTurn {
    /// `system`, `user`, `assistant`…
    pub role: RString,
    /// The message text.
    pub content: RString,
}

/// One generation request as the engine sees it.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    /// The model name the client asked for.
    pub model: RString,
    /// The prompt text, used as is when `messages` is empty.
    pub prompt: RString,
    /// A chat conversation. When non-empty, the engine renders it with the model's own chat
    /// template (ready for the assistant's turn) and ignores `prompt`, so a transport never
    /// needs model-specific template logic.
    pub messages: RVec<ChatTurn>,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Strings that end generation when produced.
    pub stop: RVec<RString>,
}

/// Why generation ended.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The sink asked to stop (client went away).
    Cancelled,
}

/// Token counts and outcome of a finished request.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct GenerateSummary {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Prompt tokens whose KV came from the cache.
    pub cached_tokens: u32,
    /// Tokens generated.
    pub generated_tokens: u32,
    /// Why it ended.
    pub finish: FinishReason,
}

/// Receives generated text as it is produced.
#[sabi_trait]
pub trait TokenSink: Send {
    /// Called per token with its id and the text it completes (possibly empty while a UTF-8
    /// sequence is incomplete). Returns `false` to cancel the request.
    fn token(&mut self, id: u32, text: RStr<'_>) -> bool;
}

/// The engine the host wires from loader, architecture, tokenizer and cache plugins.
#[sabi_trait]
pub trait Engine: Send + Sync + Clone {
    /// Names of the models this engine serves.
    fn models(&self) -> RVec<RString>;

    /// Runs one request to completion, streaming into `sink`.
    fn generate(
        &self,
        request: &GenerateRequest,
        sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError>;
}

/// Tells a transport when the host wants it to stop.
#[sabi_trait]
pub trait Shutdown: Send + Sync + Clone {
    /// Whether shutdown was requested.
    fn requested(&self) -> bool;

    /// Blocks up to `timeout_ms` for a shutdown request; returns whether one came.
    fn wait(&self, timeout_ms: u64) -> bool;
}

/// Everything a transport gets when asked to serve.
#[repr(C)]
#[derive(StableAbi)]
pub struct TransportContext {
    /// The engine to send requests to.
    pub engine: EngineBox,
    /// Shutdown signal; finish in-flight work and return once it fires.
    pub shutdown: ShutdownBox,
    /// Sockets the host opened for this transport's `net.listen` grant.
    pub listeners: RVec<Listener>,
}

/// Entry interface of a `transport` plugin.
#[sabi_trait]
pub trait Transport: Send + Sync {
    /// Serves until shutdown is requested (or the transport has nothing left to do).
    fn serve(&self, context: TransportContext) -> RResult<(), UError>;
}

/// An owned sink object.
pub type TokenSinkBox = TokenSink_TO<'static, RBox<()>>;
/// An owned engine object.
pub type EngineBox = Engine_TO<'static, RBox<()>>;
/// An owned shutdown object.
pub type ShutdownBox = Shutdown_TO<'static, RBox<()>>;
/// An owned transport object.
pub type TransportBox = Transport_TO<'static, RBox<()>>;
