//! # u-runner-transcription — the speech recognition runner plugin
//!
//! A `runner` plugin for the **transcription** task: the host hands it a cross-decoder (a model
//! of [`ModelKind::CrossDecoder`], e.g. Whisper built by `arch-whisper`) and its tokenizer, and
//! it serves [`Engine::transcribe`]: the uploaded file is decoded (WAV, FLAC, MP3 with
//! `u-audio`) and resampled to 16 kHz mono, and openai-whisper's transcription loop runs over
//! it ([`transcribe`]): 30 s log-mel windows, each decoded ([`decode`]) under Whisper's logit
//! rules ([`vocab`]: suppressed tokens, timestamp grammar) with the previous text as its
//! prompt, temperature fallback on repetitive or unlikely output, silence skipped. Requests run
//! on the caller's thread, at most `max_running` at once; each window's encoded audio lives in
//! the model's cache only while the window decodes.
#![deny(missing_docs)]

pub mod decode;
pub mod transcribe;
pub mod vocab;

use abi_stable::std_types::{RResult, RSlice, RStr, RString, RVec};
use std::sync::{
    Arc,
    atomic::{AtomicU32, AtomicU64, Ordering},
};
use u_sdk::{
    CheckpointInfo, CheckpointRequest, Engine, EngineBox, EngineStats, ErrorKind, GenerateRequest,
    GenerateSummary, HostBox, KvCacheBox, ModelBox, ModelConfig, ModelKind, PluginInfo,
    PluginInstance, Runner, RunnerBox, RunnerContext, TokenSinkBox, TokenizeRequest, TokenizerBox,
    TranscribeRequest, Transcript, UError,
};
use vocab::Specials;

/// Requests transcribing at once unless the deployment says otherwise.
const DEFAULT_RUNNING: u32 = 4;
/// The most beams a request may ask for.
pub const MAX_BEAMS: u32 = 16;
/// The longest recording accepted, in seconds: a bound on work and memory per request (decoding
/// stops there; two hours of 48 kHz stereo take about 2.8 GB while decoded).
pub const MAX_SECONDS: f64 = 2.0 * 3600.0;
/// The shortest decoder context that leaves room for a prompt and a transcript.
const MIN_CONTEXT: u32 = 16;

/// The `runner` entry object.
#[derive(Clone, Copy, Debug, Default)]
pub struct TranscriptionRunner;

impl TranscriptionRunner {
    /// Serves `model` with `tokenizer` under `name` and `aliases`, at most `max_running`
    /// requests at once (0: the default); what [`Runner::start`] does, for Rust callers.
    pub fn serve(
        &self,
        (name, aliases): (&str, Vec<String>),
        model: ModelBox,
        tokenizer: Option<TokenizerBox>,
        max_running: u32,
    ) -> u_sdk::Result<Transcriber> {
        let config = model.config().into_result()?;
        if config.kind != ModelKind::CrossDecoder {
            return Err(UError::invalid(format!(
                "runner-transcription serves cross-decoders (Whisper); `{}` is a {:?} model",
                config.family, config.kind
            )));
        }
        let [n_mels, frames] = config.context_shape;
        if frames as usize != transcribe::N_FRAMES {
            return Err(UError::invalid(format!(
                "runner-transcription: the model reads {frames} frames; Whisper's windows are {}",
                transcribe::N_FRAMES
            )));
        }
        let tokenizer = tokenizer.ok_or_else(|| {
            UError::invalid(format!(
                "runner-transcription: `{name}` has no tokenizer (no tokenizer.json beside it)"
            ))
        })?;
        let cache =
            model.cache().into_result()?.into_option().ok_or_else(|| {
                UError::invalid("runner-transcription: the model keeps no KV cache")
            })?;
        if config.context_length < MIN_CONTEXT {
            return Err(UError::invalid(format!(
                "runner-transcription: a decoder context of {} tokens (at least {MIN_CONTEXT})",
                config.context_length
            )));
        }
        let specials = Specials::find(&tokenizer, config.vocab_size as usize)?;
        let suppress = vocab::suppressed(&tokenizer, &specials)?;
        let blank = tokenizer.encode(" ".into(), false, false).into_result()?;
        let mut suppress_blank: Vec<u32> = blank.into_iter().collect();
        suppress_blank.push(specials.eot);
        // Every id the rules index logits with must be a text or special token of this model:
        // below the first timestamp, which itself lies inside the vocabulary.
        let tb = specials.timestamp_begin;
        let ids = [
            specials.eot,
            specials.sot,
            specials.translate,
            specials.transcribe,
            specials.sot_lm,
            specials.sot_prev,
            specials.no_speech,
            specials.no_timestamps,
        ];
        let languages = specials.languages.iter().map(|(id, _)| *id);
        let all = ids
            .into_iter()
            .chain(languages)
            .chain(suppress.iter().copied());
        if tb >= config.vocab_size || all.chain(suppress_blank.iter().copied()).any(|id| id >= tb) {
            return Err(UError::invalid(
                "runner-transcription: the tokenizer's special tokens do not fit the model's \
                 vocabulary (a tokenizer of another model?)",
            ));
        }
        Ok(Transcriber(Arc::new(Inner {
            name: name.into(),
            aliases,
            model,
            tokenizer,
            cache,
            config,
            n_mels: n_mels as usize,
            specials,
            suppress,
            suppress_blank,
            max_running: if max_running == 0 {
                DEFAULT_RUNNING
            } else {
                max_running
            },
            requests: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            running: AtomicU32::new(0),
            generated: AtomicU64::new(0),
        })))
    }
}

impl Runner for TranscriptionRunner {
    fn start(&self, context: RunnerContext) -> RResult<EngineBox, UError> {
        let aliases = context.aliases.iter().map(|a| a.to_string()).collect();
        self.serve(
            (context.name.as_str(), aliases),
            context.model,
            context.tokenizer.into_option(),
            context.limits.max_running,
        )
        .map(EngineBox::new)
        .into()
    }
}

struct Inner {
    name: String,
    aliases: Vec<String>,
    model: ModelBox,
    tokenizer: TokenizerBox,
    cache: KvCacheBox,
    config: ModelConfig,
    n_mels: usize,
    specials: Specials,
    suppress: Vec<u32>,
    suppress_blank: Vec<u32>,
    max_running: u32,
    requests: AtomicU64,
    rejected: AtomicU64,
    running: AtomicU32,
    generated: AtomicU64,
}

/// A speech model served as an [`Engine`] that transcribes. Clones share the model.
#[derive(Clone)]
pub struct Transcriber(Arc<Inner>);

/// Releases a running slot when a request ends however it ends.
struct Slot<'a>(&'a AtomicU32);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Transcriber {
    fn check_model(&self, model: &str) -> u_sdk::Result<()> {
        match model == self.0.name || u_sdk::serves(&self.0.aliases, model) {
            true => Ok(()),
            false => Err(UError::not_found(format!(
                "model `{model}` is not served (this engine serves `{}`)",
                self.0.name
            ))),
        }
    }

    /// The suppressed token ids (openai-whisper's list for this vocabulary).
    pub fn suppressed(&self) -> &[u32] {
        &self.0.suppress
    }

    /// Transcribes 16 kHz mono samples.
    pub fn transcribe_samples(
        &self,
        samples: &[f32],
        request: &TranscribeRequest,
    ) -> u_sdk::Result<Transcript> {
        let i = &self.0;
        let s = &i.specials;
        let duration = samples.len() as f64 / f64::from(u_audio::SAMPLE_RATE);
        if samples.is_empty() {
            return Err(UError::invalid(
                "runner-transcription: the audio holds no samples",
            ));
        }
        if duration > MAX_SECONDS {
            return Err(UError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "runner-transcription: {duration:.0} s of audio; at most {MAX_SECONDS:.0} s"
                ),
            ));
        }
        if request.beam_size > MAX_BEAMS {
            return Err(UError::invalid(format!(
                "runner-transcription: {} beams; at most {MAX_BEAMS}",
                request.beam_size
            )));
        }
        if !(0.0..=1.0).contains(&request.temperature) {
            return Err(UError::invalid(format!(
                "runner-transcription: temperature {} is outside 0–1",
                request.temperature
            )));
        }
        let spectrogram = transcribe::Spectrogram::of(samples, i.n_mels)?;
        let mut job = transcribe::Job {
            decoder: decode::Decoder {
                model: &i.model,
                cache: &i.cache,
                vocab: i.config.vocab_size as usize,
                specials: s,
                suppress: &i.suppress,
                suppress_blank: &i.suppress_blank,
                sample_len: i.config.context_length as usize / 2,
                context: i.config.context_length as usize,
                beam_size: request.beam_size.max(1) as usize,
            },
            tokenizer: &i.tokenizer,
            n_mels: i.n_mels,
            start: vec![s.sot],
            timestamps: request.timestamps,
            condition_on_previous: request.condition_on_previous,
            temperature: request.temperature,
            prompt: Vec::new(),
            context: i.config.context_length as usize,
        };
        let language = if s.multilingual() {
            let code = match request.language.as_str() {
                "" => job.detect_language(&spectrogram)?,
                code => code.to_lowercase(),
            };
            let id = s.language(&code).ok_or_else(|| {
                UError::invalid(format!("runner-transcription: unknown language `{code}`"))
            })?;
            job.start.extend([
                id,
                if request.translate {
                    s.translate
                } else {
                    s.transcribe
                },
            ]);
            code
        } else {
            if request.translate {
                return Err(UError::invalid(
                    "runner-transcription: an English-only model cannot translate",
                ));
            }
            if !matches!(
                request.language.to_lowercase().as_str(),
                "" | "en" | "english"
            ) {
                return Err(UError::invalid(format!(
                    "runner-transcription: an English-only model; asked for language `{}`",
                    request.language
                )));
            }
            "en".into()
        };
        if !request.timestamps {
            job.start.push(s.no_timestamps);
        }
        let prompt = request.prompt.trim();
        if !prompt.is_empty() {
            let text = format!(" {prompt}");
            job.prompt = i
                .tokenizer
                .encode(text.as_str().into(), false, false)
                .into_result()?
                .into_vec();
        }
        let segments = job.run(&spectrogram)?;
        let tokens: u64 = segments.iter().map(|x| x.tokens.len() as u64).sum();
        i.generated.fetch_add(tokens, Ordering::Relaxed);
        let text: String = segments.iter().map(|x| x.text.as_str()).collect();
        Ok(Transcript {
            text: text.trim().into(),
            language: language.into(),
            duration,
            segments: segments.into(),
        })
    }

    fn transcribe_request(&self, request: &TranscribeRequest) -> u_sdk::Result<Transcript> {
        self.check_model(&request.model)?;
        let i = &self.0;
        if i.running.fetch_add(1, Ordering::AcqRel) >= i.max_running {
            i.running.fetch_sub(1, Ordering::AcqRel);
            i.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(UError::new(
                ErrorKind::Busy,
                format!(
                    "runner-transcription: {} requests are transcribing; try again later",
                    i.max_running
                ),
            ));
        }
        let _slot = Slot(&i.running);
        i.requests.fetch_add(1, Ordering::Relaxed);
        let audio = u_audio::decode::decode_at_most(request.audio.to_vec(), MAX_SECONDS)
            .map_err(|e| UError::invalid(e.0))?;
        let samples = audio
            .mono_at(u_audio::SAMPLE_RATE)
            .map_err(|e| UError::invalid(e.0))?;
        self.transcribe_samples(&samples, request)
    }

    fn not_this_task(&self, what: &str) -> UError {
        UError::unsupported(format!(
            "`{}` is a speech recognition model: {what} needs a text-generation model",
            self.0.name
        ))
    }
}

impl Engine for Transcriber {
    fn models(&self) -> RResult<RVec<RString>, UError> {
        let names = std::iter::once(&self.0.name).chain(&self.0.aliases);
        RResult::ROk(names.map(|n| RString::from(n.as_str())).collect())
    }

    fn generate(
        &self,
        request: &GenerateRequest,
        _sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError> {
        match self.check_model(&request.model) {
            Ok(()) => RResult::RErr(self.not_this_task("text generation")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn stats(&self) -> RResult<EngineStats, UError> {
        let i = &self.0;
        let kv_bytes = i.cache.stats().into_result().map(|s| s.bytes).unwrap_or(0);
        RResult::ROk(EngineStats {
            requests: i.requests.load(Ordering::Relaxed),
            rejected: i.rejected.load(Ordering::Relaxed),
            running: i.running.load(Ordering::Relaxed),
            queue_capacity: i.max_running,
            generated_tokens: i.generated.load(Ordering::Relaxed),
            kv_bytes,
            ..EngineStats::default()
        })
    }

    fn flush_cache(&self, model: RStr<'_>) -> RResult<u64, UError> {
        // Encoded audio lives only while its window decodes: nothing to flush.
        self.check_model(model.as_str()).map(|()| 0).into()
    }

    fn checkpoint(&self, request: &CheckpointRequest) -> RResult<RVec<CheckpointInfo>, UError> {
        match self.check_model(&request.model) {
            Ok(()) => RResult::RErr(self.not_this_task("a KV checkpoint")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn embed(&self, model: RStr<'_>, _input: RStr<'_>) -> RResult<RVec<f32>, UError> {
        match self.check_model(model.as_str()) {
            Ok(()) => RResult::RErr(self.not_this_task("an embedding")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn tokenize(&self, request: &TokenizeRequest) -> RResult<RVec<u32>, UError> {
        (|| {
            self.check_model(&request.model)?;
            self.0
                .tokenizer
                .encode(request.prompt.as_str().into(), request.add_special, true)
                .into_result()
        })()
        .into()
    }

    fn detokenize(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<u8>, UError> {
        (|| {
            self.check_model(model.as_str())?;
            let mut bytes = Vec::new();
            for &id in tokens.iter() {
                bytes.extend_from_slice(&self.0.tokenizer.token_bytes(id).into_result()?);
            }
            Ok(RVec::from(bytes))
        })()
        .into()
    }

    fn embed_tokens(
        &self,
        model: RStr<'_>,
        _tokens: RSlice<'_, u32>,
    ) -> RResult<RVec<f32>, UError> {
        match self.check_model(model.as_str()) {
            Ok(()) => RResult::RErr(self.not_this_task("an embedding")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn embed_image(&self, model: RStr<'_>, _: RSlice<'_, u8>) -> RResult<RVec<f32>, UError> {
        match self.check_model(model.as_str()) {
            Ok(()) => RResult::RErr(u_sdk::not_an_image_model(model.as_str())),
            Err(e) => RResult::RErr(e),
        }
    }

    fn transcribe(&self, request: &TranscribeRequest) -> RResult<Transcript, UError> {
        self.transcribe_request(request).into()
    }
}

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "transcription: Whisper's 30 s windows, timestamps, temperature fallback".into(),
        details: RVec::new(),
    }
}

/// Creates the runner (the root module's `instantiate`); it takes no settings.
fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    u_sdk::settings::none(&host, "runner-transcription", "runner")?;
    Ok(PluginInstance::Runner(RunnerBox::new(TranscriptionRunner)))
}

/// The exported root module and embedded manifest.
mod export {
    u_sdk::export_plugin! {
        manifest: "plugin.toml",
        describe: super::describe,
        instantiate: super::instantiate,
    }
}
