//! Transport plugins: carry requests from clients to the engine a runner plugin serves.
//!
//! A transport never opens sockets itself: the host creates the listeners the deployment grants
//! (`net.listen`) before the process is locked down, and passes their file descriptors in the
//! [`TransportContext`].

use crate::abi::{error::UError, model::AdapterInfo};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec},
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
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
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
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ChatTurn {
    /// `system`, `user`, `assistant`…
    pub role: RString,
    /// The message text.
    pub content: RString,
    /// Images in the message, in order (OpenAI `image_url` parts, Anthropic `image` blocks);
    /// empty for text alone. A model that reads no images refuses a turn with any.
    pub images: RVec<ChatImage>,
}

impl ChatTurn {
    /// A turn of text alone.
    pub fn text(role: &str, content: &str) -> ChatTurn {
        ChatTurn {
            role: role.into(),
            content: content.into(),
            images: RVec::new(),
        }
    }
}

/// An image in a chat turn: the file as sent, decoded and preprocessed by the engine for its
/// model.
#[repr(C)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ChatImage {
    /// The image file's bytes (PNG, JPEG, WebP, GIF or BMP).
    pub data: RVec<u8>,
    /// Where in the turn's content it stands: a byte offset, at a character boundary.
    pub offset: u32,
}

/// A prompt-cache breakpoint: the KV of the rendered prompt up to the end of
/// `messages[turn].content[..offset]` (a byte offset) is kept, so a later request that starts
/// with the same text prefills only what follows. Any number of breakpoints may be given.
#[repr(C)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheBreakpoint {
    /// Index into [`GenerateRequest::messages`].
    pub turn: u32,
    /// Byte offset into that turn's content where the cached block ends.
    pub offset: u32,
}

/// One generation request as the engine sees it.
#[repr(C)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
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
    /// Where to keep prompt KV for later requests (on top of the engine's automatic prefix
    /// caching of whole prompts).
    pub cache_breakpoints: RVec<CacheBreakpoint>,
    /// `RSome(n)`: report each generated token's log-probability and the `n` most likely
    /// alternatives (see [`GeneratedToken`]).
    pub top_logprobs: ROption<u32>,
    /// Continue the named KV checkpoint: the prompt (encoded without BOS) is appended to the
    /// checkpoint's tokens instead of starting a new sequence.
    pub resume_from: ROption<RString>,
    /// After generation, save the sequence (prompt and generated tokens) as this checkpoint.
    pub save_as: ROption<RString>,
    /// Who is asking, for fair queueing: requests waiting for a running slot are admitted
    /// client by client (fewest running first), so one client's burst cannot starve another.
    /// Transports set it from the request's declared user or else the connection's peer;
    /// empty is one anonymous client. A fairness key, not an identity check.
    pub client: RString,
    /// The prompt as token ids: when non-empty it is used as is (nothing added) instead of
    /// `prompt` and `messages`.
    pub prompt_tokens: RVec<u32>,
    /// Added to these tokens' logits before sampling (OpenAI's `logit_bias`; -100 bans one).
    pub logit_bias: RVec<LogitBias>,
    /// Continue the last of `messages` (an assistant prefill) instead of opening a new turn.
    pub continue_final: bool,
    /// Text that follows the completion (fill-in-the-middle); refused for a model without
    /// FIM tokens.
    pub suffix: ROption<RString>,
    /// `true`: `max_tokens` is cut to what the context leaves after the prompt; `false` (the
    /// client asked for that many): a prompt plus `max_tokens` beyond the context is refused.
    pub clamp_max_tokens: bool,
    /// A grammar the generated text must follow (structured outputs); the engine masks every
    /// token the grammar cannot take and ends generation when the grammar is complete.
    pub constraint: Constraint,
    /// The tools the model may call, a JSON array in OpenAI's shape
    /// (`[{"type": "function", "function": {"name", "description", "parameters"}}]`); empty for
    /// none. The engine gives them to a chat template that renders `tools` (as transformers'
    /// `apply_chat_template(tools=…)`), and otherwise describes them in the system prompt
    /// (Qwen2.5's wording).
    pub tools: RString,
    /// Who owns the checkpoints `resume_from` and `save_as` name: the authenticated client (a
    /// named HMAC key's id, an API key's name, a Unix peer's uid), set by the transport; empty
    /// for clients it cannot tell apart (unauthenticated TCP, one shared HMAC secret), who
    /// share one namespace. A checkpoint is visible only to its owner: another owner's is
    /// simply not found.
    pub owner: RString,
    /// `save_as` may replace an existing checkpoint of that name (otherwise that is an
    /// [`AlreadyExists`](crate::abi::error::ErrorKind::AlreadyExists) error, before any work).
    pub overwrite: bool,
    /// Low-rank adapters this request runs under, by the names the model holds them by, with
    /// their scales (empty: the base model). Requests under different adapters share forward
    /// passes; KV computed under one set of adapters is never reused under another.
    pub adapters: RVec<AdapterUse>,
    /// Control vectors this request runs under, by the names the deployment loaded them as.
    pub control_vectors: RVec<ControlUse>,
    /// The soft prompt (by name) whose rows stand before the prompt; empty for none. Its
    /// virtual tokens count in the prompt's tokens but are never in the text.
    pub soft_prompt: RString,
    /// Generate past end-of-sequence tokens, up to `max_tokens` (vLLM's and llama-server's
    /// `ignore_eos`, for load tests of a fixed length).
    pub ignore_eos: bool,
}

/// One control vector a request runs under.
#[repr(C)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub struct ControlUse {
    /// The vector's name.
    pub name: RString,
    /// Its multiplier (0 changes nothing).
    pub strength: f32,
    /// The first block it applies after.
    pub first_layer: u32,
    /// The last block it applies after (inclusive; `u32::MAX`: through the last).
    pub last_layer: u32,
}

/// One adapter a request runs under.
#[repr(C)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub struct AdapterUse {
    /// The adapter's name, as the model holds it.
    pub name: RString,
    /// Multiplier of its delta (1: as trained).
    pub scale: f32,
}

/// What the generated text must match (compiled by the runner; an invalid one is refused).
#[repr(u8)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub enum Constraint {
    /// Free text.
    #[default]
    None,
    /// A JSON document valid against this JSON Schema (its text; `{"type":"object"}` is any
    /// object).
    JsonSchema(RString),
    /// Text matching this regular expression (Rust `regex` syntax, anchored at both ends).
    Regex(RString),
    /// Text in the language of this Lark grammar (llguidance's Lark dialect, `start` rule).
    Lark(RString),
}

/// A bias added to one token's logit.
#[repr(C)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq)]
pub struct LogitBias {
    /// Token id.
    pub id: u32,
    /// Added to its logit.
    pub bias: f32,
}

/// Text or a conversation to tokenize as a generation request would.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct TokenizeRequest {
    /// The model name.
    pub model: RString,
    /// Text, used when `messages` is empty.
    pub prompt: RString,
    /// A conversation, rendered with the chat template (ready for the assistant's turn).
    pub messages: RVec<ChatTurn>,
    /// Continue the last message instead of opening the assistant's turn.
    pub continue_final: bool,
    /// Add the special tokens (BOS) the model's tokenizer adds to a prompt.
    pub add_special: bool,
}

impl GenerateRequest {
    /// A plain-prompt request with the given sampling settings and nothing else set.
    pub fn new(model: &str, prompt: &str, max_tokens: u32, sampling: SamplingParams) -> Self {
        Self {
            model: model.into(),
            prompt: prompt.into(),
            messages: RVec::new(),
            max_tokens,
            sampling,
            stop: RVec::new(),
            cache_breakpoints: RVec::new(),
            top_logprobs: ROption::RNone,
            resume_from: ROption::RNone,
            save_as: ROption::RNone,
            client: RString::new(),
            prompt_tokens: RVec::new(),
            logit_bias: RVec::new(),
            continue_final: false,
            suffix: ROption::RNone,
            clamp_max_tokens: true,
            constraint: Constraint::None,
            tools: RString::new(),
            owner: RString::new(),
            overwrite: false,
            adapters: RVec::new(),
            control_vectors: RVec::new(),
            soft_prompt: RString::new(),
            ignore_eos: false,
        }
    }
}

/// A token and its log-probability under the sampling distribution's source logits.
#[repr(C)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// Token id.
    pub id: u32,
    /// The token's bytes (not necessarily valid UTF-8 on their own).
    pub bytes: RVec<u8>,
    /// Natural log of its probability under the model's logits (before sampling filters).
    pub logprob: f32,
}

/// What the engine streams per generated token.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct GeneratedToken<'a> {
    /// The token id (for the final flush of held-back text: the last token's id).
    pub id: u32,
    /// The text this token completes (possibly empty while a UTF-8 sequence or a possible stop
    /// string is incomplete).
    pub text: RStr<'a>,
    /// The token with its log-probability, when the request asked for logprobs.
    pub logprob: ROption<TokenLogprob>,
    /// The most likely alternatives, best first, when the request asked for them.
    pub top_logprobs: RSlice<'a, TokenLogprob>,
}

/// Why generation ended.
#[repr(u8)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
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
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub struct GenerateSummary {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Prompt tokens whose KV came from the cache.
    pub cached_tokens: u32,
    /// Prompt tokens whose KV was newly stored at cache breakpoints.
    pub cache_written_tokens: u32,
    /// Tokens generated.
    pub generated_tokens: u32,
    /// The generated token ids (an end-of-sequence token that ended generation excluded).
    pub tokens: RVec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// The stop string that ended generation, if one did (`finish` is then `Stop`).
    pub stop_sequence: ROption<RString>,
    /// Prefill wall time, milliseconds.
    pub prompt_ms: f64,
    /// Decode wall time (sampling included), milliseconds.
    pub generate_ms: f64,
    /// Tokens drafted by speculative decoding (prompt lookup).
    pub draft_tokens: u32,
    /// Drafted tokens the sampler kept.
    pub accepted_tokens: u32,
}

/// Receives generated text as it is produced.
#[sabi_trait]
pub trait TokenSink: Send {
    /// Called per generated token (and once more, with `text` only, for text held back until
    /// the end). Returns `false` to cancel the request.
    fn token(&mut self, token: &GeneratedToken<'_>) -> bool;
}

/// Counters of an engine, for `/metrics`.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Requests accepted since start.
    pub requests: u64,
    /// Requests refused because the queue was full.
    pub rejected: u64,
    /// Requests now decoding or prefilling.
    pub running: u32,
    /// Requests waiting for a slot.
    pub queued: u32,
    /// Most requests that may wait before new ones are refused.
    pub queue_capacity: u32,
    /// Prompt tokens seen.
    pub prompt_tokens: u64,
    /// Prompt tokens whose KV came from the cache.
    pub cached_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Forward passes run (each may carry many requests).
    pub forward_passes: u64,
    /// Bytes of KV held by the cache.
    pub kv_bytes: u64,
    /// Tokens drafted by speculative decoding.
    pub draft_tokens: u64,
    /// Drafted tokens the sampler kept.
    pub accepted_tokens: u64,
    /// The byte budget of KV in memory (0: none).
    pub kv_capacity_bytes: u64,
    /// Low-rank adapters resident (every one of them may run in the same pass).
    pub resident_adapters: u32,
    /// Adapters the running requests use.
    pub running_adapters: RVec<RString>,
    /// Adapters the waiting requests ask for.
    pub waiting_adapters: RVec<RString>,
    /// Images whose encoder output came from the engine's cache (no encoding).
    pub image_cache_hits: u64,
    /// The model's own counters ([`crate::Model::counters`]).
    pub model_counters: RVec<crate::abi::model::ModelCounter>,
    /// The compute device the model runs on ([`crate::RunnerContext::device`]).
    pub device: RString,
}

/// One transcription request (OpenAI's `POST /v1/audio/transcriptions`, `u-runner
/// transcribe`).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct TranscribeRequest {
    /// The model name the client asked for.
    pub model: RString,
    /// The audio file's bytes as uploaded (WAV, FLAC or MP3); the runner decodes them.
    pub audio: RVec<u8>,
    /// The spoken language as an ISO-639-1 code (`en`), or empty to detect it (multilingual
    /// models only).
    pub language: RString,
    /// Translate the speech to English instead of transcribing it (multilingual models only).
    pub translate: bool,
    /// Text that conditions the first window, as the previous window's text does later
    /// (OpenAI's `prompt`).
    pub prompt: RString,
    /// The first sampling temperature; 0 is greedy. On a window whose output looks like a
    /// failure (repetitive, unlikely) the runner retries at higher temperatures, as
    /// openai-whisper does.
    pub temperature: f32,
    /// Predict segment timestamps (openai-whisper's default); without them each 30 s window is
    /// one segment.
    pub timestamps: bool,
    /// Beams of beam search at temperature 0 (openai-whisper's `beam_size`); 0 or 1 decodes
    /// greedily. Fallback temperatures sample one candidate.
    pub beam_size: u32,
    /// Prompt each window with the text before it (openai-whisper's
    /// `condition_on_previous_text`, on by default): more consistent, but a window that went
    /// wrong can carry its mistake on.
    pub condition_on_previous: bool,
    /// Who is asking, for fair queueing (see [`GenerateRequest::client`]).
    pub client: RString,
}

/// A stretch of transcribed speech.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct TranscriptSegment {
    /// The first spectrogram frame (10 ms each) of the 30 s window it was decoded in.
    pub seek: u64,
    /// Start, in seconds from the beginning of the audio.
    pub start: f64,
    /// End, in seconds.
    pub end: f64,
    /// The text.
    pub text: RString,
    /// The text's token ids (timestamp tokens included when predicted).
    pub tokens: RVec<u32>,
    /// The temperature the window was decoded at.
    pub temperature: f32,
    /// Mean log-probability of the window's tokens (the end token included).
    pub avg_logprob: f64,
    /// How much the window's text compresses with zlib (repetitive text compresses well).
    pub compression_ratio: f64,
    /// The probability the model gave its no-speech token at the window's start.
    pub no_speech_prob: f64,
}

/// The result of a transcription.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct Transcript {
    /// The whole text.
    pub text: RString,
    /// The language, as asked or detected (ISO-639-1).
    pub language: RString,
    /// Length of the audio in seconds.
    pub duration: f64,
    /// The segments, in order.
    pub segments: RVec<TranscriptSegment>,
}

/// One image-generation request (OpenAI's `POST /v1/images/generations`, `u-runner image`):
/// text to image, or, with an initial image, image to image.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct ImageRequest {
    /// The model name the client asked for.
    pub model: RString,
    /// What the image shows.
    pub prompt: RString,
    /// What it should not show (classifier-free guidance's unconditional text; empty: none).
    pub negative_prompt: RString,
    /// Width in pixels; 0: the model's default.
    pub width: u32,
    /// Height in pixels; 0: the model's default.
    pub height: u32,
    /// Denoising steps of the schedule (at least 1).
    pub steps: u32,
    /// Classifier-free guidance scale; at most 1 turns guidance off (one pass per step).
    pub guidance_scale: f32,
    /// The seed of the initial noise (and of a stochastic scheduler's noise): the same request
    /// with the same seed gives the same image.
    pub seed: u64,
    /// An image file (PNG, JPEG, WebP, GIF, BMP) to start from; empty for text to image.
    pub init_image: RVec<u8>,
    /// With an initial image: how much of it is noised away, in (0, 1] (the last
    /// `steps · strength` steps run).
    pub strength: f32,
    /// An approximate shortcut for an edited prompt: take the first `handoff_step` steps from
    /// the kept trajectory of this earlier prompt (all else the same) and run only the rest
    /// with `prompt`. The result is not the image `prompt` alone would give
    /// ([`GeneratedImage::approximate`]). Empty: none.
    pub handoff_prompt: RString,
    /// The step the handoff starts from (with `handoff_prompt`).
    pub handoff_step: u32,
    /// Values a directly conditioned denoiser reads besides its noise level (a class label,
    /// a terrain model's difficulty), as the model documents them; empty for a text-conditioned
    /// pipeline.
    pub conditioning: RVec<f32>,
    /// Who is asking, for fair queueing (see [`GenerateRequest::client`]).
    pub client: RString,
}

/// How far an image request has come, sent after each denoising step.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageProgress {
    /// Steps done.
    pub step: u32,
    /// Steps the request runs.
    pub steps: u32,
    /// Whether this step's result came from the trajectory cache rather than the model.
    pub cached: bool,
}

/// Receives an image request's progress.
#[sabi_trait]
pub trait ImageSink: Send {
    /// Called after each step. Returns `false` to cancel the request (its trajectory so far is
    /// kept, so the same request resumes where it stopped).
    fn step(&mut self, progress: &ImageProgress) -> bool;
}

/// A generated image.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct GeneratedImage {
    /// The image as a PNG file (8-bit RGB).
    pub png: RVec<u8>,
    /// Its width in pixels.
    pub width: u32,
    /// Its height in pixels.
    pub height: u32,
    /// The seed it was made from.
    pub seed: u64,
    /// Steps the request ran.
    pub steps: u32,
    /// Steps taken from the trajectory cache instead of the model (a resumed request, or a
    /// handoff).
    pub cached_steps: u32,
    /// Whether the image came from a handoff: its first steps followed another prompt.
    pub approximate: bool,
}

/// What to do with KV checkpoints.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointOp {
    /// Prefill `prompt`/`messages` (continuing `source` when it is set) and save it as `name`.
    Save,
    /// Save a copy of checkpoint `source` as `name` (pages shared, nothing copied).
    Fork,
    /// Append checkpoint `source`'s tokens to checkpoint `target` (keys re-rotated to their new
    /// positions) and save the result as `name`.
    Graft,
    /// List every checkpoint.
    List,
    /// Delete checkpoint `name`.
    Delete,
}

/// A checkpoint command (fields a given op does not use are left empty).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct CheckpointRequest {
    /// The operation.
    pub op: CheckpointOp,
    /// The model name.
    pub model: RString,
    /// The checkpoint written (or deleted).
    pub name: RString,
    /// The checkpoint read (`Fork`, `Graft`, optionally `Save`).
    pub source: RString,
    /// The checkpoint grafted onto (`Graft`).
    pub target: RString,
    /// Text to prefill (`Save`), used as is when `messages` is empty.
    pub prompt: RString,
    /// A conversation to render with the chat template and prefill (`Save`).
    pub messages: RVec<ChatTurn>,
    /// Who owns the checkpoints named (see [`GenerateRequest::owner`]).
    pub owner: RString,
    /// `Save`, `Fork`, `Graft`: replace checkpoint `name` if it exists (otherwise that is an
    /// [`AlreadyExists`](crate::abi::error::ErrorKind::AlreadyExists) error).
    pub overwrite: bool,
    /// The operator's scope (set by the transport for clients configured as admins): names
    /// are the stored ones of every owner ([`checkpoint_namespace`] and the name), `owner` is
    /// ignored, and `List` lists every owner's checkpoints.
    pub admin: bool,
}

/// The prefix of `owner`'s checkpoint names as an engine stores them, `o-<16 hex>.`: the hex
/// is the 64-bit FNV-1a hash of the owner (fixed, so persisted checkpoints stay theirs across
/// builds); empty for the shared namespace. Stored names of this form are reserved for owners.
pub fn checkpoint_namespace(owner: &str) -> String {
    if owner.is_empty() {
        return String::new();
    }
    let hash = owner.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("o-{hash:016x}.")
}

/// A checkpoint as listed.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Its name.
    pub name: RString,
    /// Tokens it holds (0 when unknown without loading it).
    pub tokens: u64,
}

/// What a runner plugin serves: the engine transports send requests to.
#[sabi_trait]
pub trait Engine: Send + Sync + Clone {
    /// Names of the model this engine serves: its name first, then its aliases (and
    /// [`ANY_MODEL`](crate::abi::runner::ANY_MODEL) when any name is served).
    fn models(&self) -> RResult<RVec<RString>, UError>;

    /// Runs one request to completion, streaming into `sink`. Fails with
    /// [`ErrorKind::Busy`](crate::abi::error::ErrorKind::Busy) when the queue is full.
    fn generate(
        &self,
        request: &GenerateRequest,
        sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError>;

    /// Counters for monitoring.
    fn stats(&self) -> RResult<EngineStats, UError>;

    /// Forgets `model`'s cached prompt prefixes (SGLang's `POST /flush_cache`); fails with
    /// [`ErrorKind::Busy`](crate::abi::error::ErrorKind::Busy) while requests run or wait, as
    /// SGLang refuses then. Returns how many prefix entries went.
    fn flush_cache(&self, model: RStr<'_>) -> RResult<u64, UError>;

    /// Saves, forks, grafts, lists or deletes KV checkpoints; returns the checkpoints the
    /// command wrote (`Save`, `Fork`, `Graft`) or all of them (`List`).
    fn checkpoint(&self, request: &CheckpointRequest) -> RResult<RVec<CheckpointInfo>, UError>;

    /// A sentence embedding of `input`: the model's pooled output over its tokens (its own
    /// pooling, e.g. the mean for sentence-transformers encoders and decoders), L2-normalised.
    fn embed(&self, model: RStr<'_>, input: RStr<'_>) -> RResult<RVec<f32>, UError>;

    /// The token ids `request` becomes, as a generation or `embed` would encode it.
    fn tokenize(&self, request: &TokenizeRequest) -> RResult<RVec<u32>, UError>;

    /// The bytes of `tokens`, concatenated (not necessarily valid UTF-8).
    fn detokenize(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<u8>, UError>;

    /// As [`Engine::embed`], from token ids used as they are.
    fn embed_tokens(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<f32>, UError>;

    /// An image embedding of `image` (a PNG, JPEG, WebP, GIF or BMP file): the image model's
    /// pooled output (its own pooling), L2-normalised; engines of models that read no images
    /// answer [`not_an_image_model`]. (Required, not defaulted: the SDK's panic guard, which
    /// wraps every engine, must forward it, and the compiler checks that only for required
    /// methods.)
    fn embed_image(&self, model: RStr<'_>, image: RSlice<'_, u8>) -> RResult<RVec<f32>, UError>;

    /// Loads low-rank adapter `name` at run time from `path` (vLLM's `POST
    /// /v1/load_lora_adapter`), which must lie in a directory the deployment allows; within the
    /// deployment's adapter byte budget, the least recently used adapter loaded this way makes
    /// room. Engines without adapters keep this default.
    fn load_adapter(&self, name: RStr<'_>, path: RStr<'_>) -> RResult<AdapterInfo, UError> {
        let _ = path;
        RResult::RErr(UError::unsupported(format!(
            "this engine loads no adapters at run time (asked to load `{name}`)"
        )))
    }

    /// Forgets an adapter loaded at run time; `false` if there was none of that name. Refused
    /// ([`Busy`](crate::abi::error::ErrorKind::Busy)) while requests run under it, and for the
    /// deployment's own adapters.
    fn unload_adapter(&self, name: RStr<'_>) -> RResult<bool, UError> {
        let _ = name;
        RResult::ROk(false)
    }

    /// Transcribes (or translates) speech. Engines of other tasks keep this default.
    fn transcribe(&self, request: &TranscribeRequest) -> RResult<Transcript, UError> {
        RResult::RErr(UError::unsupported(format!(
            "`{}` does not transcribe audio (a speech model such as Whisper does)",
            request.model
        )))
    }

    /// Generates an image, reporting each denoising step to `sink`. Engines of other tasks
    /// keep this default.
    fn generate_image(
        &self,
        request: &ImageRequest,
        sink: ImageSinkBox,
    ) -> RResult<GeneratedImage, UError> {
        let _ = sink;
        RResult::RErr(UError::unsupported(format!(
            "`{}` does not generate images (a diffusion pipeline does)",
            request.model
        )))
    }
}

/// What [`Engine::embed_image`] answers for a model that reads no images.
pub fn not_an_image_model(model: &str) -> UError {
    UError::unsupported(format!(
        "`{model}` does not embed images (an image encoder such as DINOv2 or CLIP's vision tower \
         does)"
    ))
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
/// An owned image progress sink.
pub type ImageSinkBox = ImageSink_TO<'static, RBox<()>>;
/// An owned engine object.
pub type EngineBox = Engine_TO<'static, RBox<()>>;
/// An owned shutdown object.
pub type ShutdownBox = Shutdown_TO<'static, RBox<()>>;
/// An owned transport object.
pub type TransportBox = Transport_TO<'static, RBox<()>>;
