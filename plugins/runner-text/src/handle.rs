//! [`EngineHandle`]: a [`Generator`] behind the scheduler, as the ABI's [`Engine`] for transports.

use crate::{
    Error, GenerateOptions, Generator, Limits, Result,
    extras::Extras,
    images::{ImageSettings, ImageSpan, Vision},
    ledger::Ledger,
    logprobs::MAX_TOP_LOGPROBS,
    owner::{Owner, Sharing},
    prompt::Prompt,
    sampler,
    scheduler::{Event, Scheduler},
    sequence::{Origin, Outcome, Spec},
};
use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RString, RVec};
use std::{hash::RandomState, sync::Arc};
use u_sdk::{
    AdapterInfo, AdapterOpenerBox, CheckpointInfo, CheckpointOp, CheckpointRequest, Constraint,
    Engine, EngineBox, EngineStats, ErrorKind, GenerateRequest, GenerateSummary, GeneratedToken,
    KvCacheBox, SeqId, TokenSinkBox, TokenizeRequest, UError,
};

/// A request's prompt, ready to run: tokens (image positions carrying their fingerprints),
/// breakpoints as token counts, the images' rows, and a cross-attention context.
struct Prompted {
    tokens: Vec<u32>,
    breakpoints: Vec<usize>,
    images: Vec<ImageSpan>,
    context: Option<Arc<[f32]>>,
}

impl Prompted {
    /// Tokens and breakpoints alone.
    fn tokens(tokens: Vec<u32>, breakpoints: Vec<usize>) -> Prompted {
        Prompted {
            tokens,
            breakpoints,
            images: Vec::new(),
            context: None,
        }
    }
}

/// A model served under one name through the ABI's [`Engine`] interface: requests from any
/// number of threads run together in the continuous batch of one scheduler thread (see
/// [`Limits`]). Clones share the scheduler; it stops when the last clone is dropped.
#[derive(Clone)]
pub struct EngineHandle {
    name: Arc<str>,
    /// Other names the model answers to ([`u_sdk::ANY_MODEL`]: any).
    aliases: Arc<[String]>,
    /// Which clients share cached prompt prefixes.
    sharing: Sharing,
    /// Keys the prefix cache by adapter set (per process: an adapter name may hold other
    /// weights after a restart).
    adapter_keys: RandomState,
    /// Control vectors and soft prompts, by name.
    extras: Arc<Extras>,
    /// The adapters held, pinned or loaded at run time, and who uses them.
    ledger: Arc<Ledger>,
    /// Opens adapters at run time (when the deployment allows it) and the byte budget of
    /// those (0: none).
    adapter_loading: Option<(AdapterOpenerBox, u64)>,
    /// The image encoder and its settings, for a model that reads images.
    vision: Option<Arc<Vision>>,
    /// The device the model runs on, for [`EngineStats::device`].
    device: Arc<str>,
    scheduler: Arc<Scheduler>,
}

impl EngineHandle {
    /// Serves `generator` under the model name `name` with the default [`Limits`].
    pub fn new(name: impl Into<String>, generator: Arc<Generator>) -> Self {
        Self::with_limits(name, generator, Limits::default())
    }

    /// Serves `generator` under `name`, running at most `limits.max_running` requests at once
    /// and queueing at most `limits.max_queued` more.
    pub fn with_limits(name: impl Into<String>, generator: Arc<Generator>, limits: Limits) -> Self {
        Self {
            name: name.into().into(),
            aliases: Arc::new([]),
            sharing: Sharing::default(),
            adapter_keys: RandomState::new(),
            extras: Arc::default(),
            ledger: Arc::default(),
            adapter_loading: None,
            vision: None,
            device: Arc::from(""),
            scheduler: Arc::new(Scheduler::start(generator, limits)),
        }
    }

    /// The same engine, serving requests with the deployment's control vectors and soft
    /// prompts (each checked against the model).
    pub fn with_extras(mut self, extras: Vec<u_sdk::RunnerExtra>) -> Result<Self> {
        self.extras = Arc::new(Extras::read(extras, self.generator().config())?);
        Ok(self)
    }

    /// The same engine, reading the images of chat requests with `encoder` (for a model whose
    /// config names an image token; none: images are refused).
    pub fn with_images(
        mut self,
        encoder: Option<u_sdk::ModelBox>,
        settings: ImageSettings,
    ) -> Result<Self> {
        let g = self.generator();
        if g.config().kind == u_sdk::ModelKind::CrossDecoder
            && (encoder.is_none() || g.config().image_token == u_sdk::NO_IMAGE_TOKEN)
        {
            return Err(Error::Unsupported(format!(
                "`{}` cross-attends to images: it needs its image encoder and image token",
                g.config().family
            )));
        }
        self.vision = match (encoder, g.config().image_token) {
            (None, _) | (_, u_sdk::NO_IMAGE_TOKEN) => None,
            (Some(encoder), _) => {
                let tokenizer = g.tokenizer().ok_or(Error::NoTokenizer)?;
                Some(Arc::new(Vision::new(
                    g.config(),
                    encoder,
                    tokenizer,
                    settings,
                )?))
            }
        };
        Ok(self)
    }

    /// The image token of the model's images (for a cross-decoder's context).
    fn vision_token(&self) -> u32 {
        self.vision
            .as_ref()
            .map_or(u_sdk::NO_IMAGE_TOKEN, |v| v.token())
    }

    /// The same engine, sharing cached prompt prefixes as `sharing` says.
    pub fn with_sharing(mut self, sharing: Sharing) -> Self {
        self.sharing = sharing;
        self
    }

    /// The same engine, answering to `aliases` too (`[model] aliases`; [`u_sdk::ANY_MODEL`]
    /// for any name).
    pub fn with_aliases(mut self, aliases: Vec<String>) -> Self {
        self.aliases = aliases.into();
        self
    }

    /// The same engine, reporting `device` as the one its model runs on.
    pub fn with_device(mut self, device: &str) -> Self {
        self.device = device.into();
        self
    }

    /// The same engine, loading adapters at run time through `opener` within `budget` bytes
    /// (0: no limit); the adapters the model holds now are pinned.
    pub fn with_adapter_loading(mut self, opener: Option<AdapterOpenerBox>, budget: u64) -> Self {
        if let Ok(held) = self.generator().model().adapters().into_result() {
            self.ledger
                .pin(held.into_iter().map(|a| a.name.into_string()));
        }
        self.adapter_loading = opener.map(|o| (o, budget));
        self
    }

    /// Loads adapter `name` from `path` at run time (see [`Engine::load_adapter`]).
    fn load_at_run_time(&self, name: &str, path: &str) -> std::result::Result<AdapterInfo, UError> {
        let Some((opener, budget)) = &self.adapter_loading else {
            return Err(UError::unsupported(
                "loading adapters at run time is off: the deployment allows no adapter_dirs",
            ));
        };
        if name.is_empty() || name.contains(':') || self.serves(name) {
            return Err(UError::invalid(format!(
                "`{name}` is not a name an adapter can take"
            )));
        }
        if self.ledger.holds(name) {
            return Err(UError::new(
                ErrorKind::AlreadyExists,
                format!("the adapter `{name}` has already been loaded"),
            ));
        }
        let opened = opener.open(path.into()).into_result()?;
        let model = self.generator().model();
        let info = model
            .load_adapter(name.into(), opened.weights, opened.config.as_str().into())
            .into_result()?;
        match self.ledger.add(name, info.bytes, *budget) {
            Ok(evicted) => {
                for old in evicted {
                    model.unload_adapter(old.as_str().into()).into_result()?;
                }
                Ok(info)
            }
            Err(short) => {
                model.unload_adapter(name.into()).into_result()?;
                Err(UError::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "adapter `{name}` ({} bytes) does not fit in the adapter budget of {budget} bytes: \
                         {short} bytes more are held by adapters in use",
                        info.bytes
                    ),
                ))
            }
        }
    }

    /// Unloads run-time adapter `name` (see [`Engine::unload_adapter`]).
    fn unload_at_run_time(&self, name: &str) -> std::result::Result<bool, UError> {
        if self.ledger.is_pinned(name) {
            return Err(UError::invalid(format!(
                "the adapter `{name}` is the deployment's ([model.adapters]); it stays loaded"
            )));
        }
        if !self.ledger.holds(name) {
            return Ok(false);
        }
        if self.ledger.users(name) > 0 {
            return Err(UError::new(
                ErrorKind::Busy,
                format!("requests are running under the adapter `{name}`; retry when they end"),
            ));
        }
        self.ledger.remove(name);
        self.generator()
            .model()
            .unload_adapter(name.into())
            .into_result()
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.scheduler.limits()
    }

    /// The generator requests run on.
    pub fn generator(&self) -> &Arc<Generator> {
        self.scheduler.generator()
    }

    /// As an ABI object for transports.
    pub fn into_box(self) -> EngineBox {
        EngineBox::new(self)
    }

    fn check_model(&self, model: &str) -> std::result::Result<(), UError> {
        if self.serves(model) || self.adapter_named(model).is_some() {
            Ok(())
        } else {
            Err(UError::not_found(format!(
                "model `{model}` is not served (this engine serves `{}`)",
                self.name
            )))
        }
    }

    fn serves(&self, model: &str) -> bool {
        model == &*self.name || u_sdk::serves(&self.aliases, model)
    }

    /// The adapter a model name asks for: `base:adapter` (the base one of this engine's
    /// names) or the adapter's own name, as vLLM routes adapters by `model`.
    fn adapter_named(&self, model: &str) -> Option<String> {
        let held = self.generator().model().adapters().into_result().ok()?;
        let holds = |a: &str| held.iter().any(|h| h.name == a);
        match model.rsplit_once(':') {
            Some((base, adapter)) if self.serves(base) && holds(adapter) => Some(adapter.into()),
            _ if holds(model) && !self.serves(model) => Some(model.into()),
            _ => None,
        }
    }

    /// The adapters `request` runs under: those it names (`#N`: the `N`-th the model lists),
    /// and the one its model name asks for (at scale 1 unless also named), each held by the
    /// model. Scale 0 leaves one out.
    fn adapters_of(&self, request: &GenerateRequest) -> Result<Vec<(String, f32)>> {
        let held = self
            .generator()
            .model()
            .adapters()
            .into_result()
            .map_err(|e| Error::plugin("model.adapters", e))?;
        let mut adapters: Vec<(String, f32)> = Vec::new();
        for a in request.adapters.iter() {
            if !a.scale.is_finite() {
                return Err(Error::InvalidRequest(format!(
                    "adapter `{}` at scale {}",
                    a.name, a.scale
                )));
            }
            let name = match a.name.strip_prefix('#').map(str::parse::<usize>) {
                Some(Ok(i)) => match held.get(i) {
                    Some(h) => h.name.to_string(),
                    None => {
                        return Err(Error::NotFound(format!(
                            "adapter #{i}: {} adapters are loaded",
                            held.len()
                        )));
                    }
                },
                _ => a.name.to_string(),
            };
            match adapters.iter_mut().find(|(n, _)| *n == name) {
                Some(seen) => seen.1 += a.scale,
                None => adapters.push((name, a.scale)),
            }
        }
        if let Some(name) = self.adapter_named(&request.model)
            && !adapters.iter().any(|(n, _)| *n == name)
        {
            adapters.push((name, 1.0));
        }
        adapters.retain(|(_, scale)| *scale != 0.0);
        if let Some((missing, _)) = adapters
            .iter()
            .find(|(n, _)| !held.iter().any(|h| h.name == n.as_str()))
        {
            return Err(Error::NotFound(format!(
                "adapter `{missing}` is not loaded (loaded: {})",
                held.iter()
                    .map(|h| h.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        adapters.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(adapters)
    }

    /// The normalised embedding of `tokens`.
    fn embed_ids(&self, tokens: &[u32]) -> Result<RVec<f32>> {
        let g = self.generator();
        let vocab = g.config().vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t >= vocab) {
            return Err(Error::TokenOutOfRange { id, vocab });
        }
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let context = g.config().context_length as usize;
        if context > 0 && tokens.len() > context {
            return Err(Error::ContextFull {
                prompt: tokens.len(),
                context,
            });
        }
        // On the caller's thread, in a scratch sequence, beside the scheduler's passes.
        let mut v = g.embed(tokens)?;
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        if norm > 0.0 {
            v.iter_mut().for_each(|x| *x /= norm);
        }
        Ok(RVec::from(v))
    }

    fn cache(&self) -> KvCacheBox {
        self.generator().cache().clone()
    }

    /// Runs `spec` through the scheduler for `client` (the fair-queueing key), forwarding its
    /// pieces to `sink` (which returns `false` to cancel).
    fn run(
        &self,
        spec: Spec,
        client: &str,
        sink: &mut dyn FnMut(&GeneratedToken<'_>) -> bool,
    ) -> Result<Outcome> {
        let ticket = self.scheduler.submit(spec, client)?;
        let (mut last, mut live) = (0, true);
        for event in ticket.events.iter() {
            let piece = match event {
                Event::Piece(piece) => piece,
                Event::Done(outcome) => return outcome,
            };
            last = piece.id.unwrap_or(last);
            if live {
                live = sink(&GeneratedToken {
                    id: last,
                    text: piece.text.as_str().into(),
                    logprob: piece.logprob.into(),
                    top_logprobs: RSlice::from_slice(&piece.top),
                });
                if !live {
                    ticket.cancel();
                }
            }
        }
        Err(Error::Stopped)
    }

    /// A request's prompt as tokens (its ids as given, a fill-in-the-middle prompt, its text or
    /// its rendered messages), its breakpoints as token counts, and its images.
    fn prompt_tokens(&self, request: &GenerateRequest, continuation: bool) -> Result<Prompted> {
        let prompted = self.prompted(request, continuation)?;
        match &self.vision {
            Some(v) if v.is_cross() && prompted.context.is_none() => {
                Err(Error::Unsupported(format!(
                    "`{}` reads an image with every prompt (cross-attention fusion: text alone is \
                 not supported); send one image in a user message",
                    self.name
                )))
            }
            _ => Ok(prompted),
        }
    }

    fn prompted(&self, request: &GenerateRequest, continuation: bool) -> Result<Prompted> {
        let g = self.generator();
        if !request.prompt_tokens.is_empty() {
            if request.suffix.is_some() {
                return Err(Error::InvalidRequest(
                    "`suffix` needs a text prompt, not token ids".into(),
                ));
            }
            return Ok(Prompted::tokens(request.prompt_tokens.to_vec(), Vec::new()));
        }
        if request.messages.iter().any(|m| !m.images.is_empty()) {
            let vision = self.vision.as_ref().ok_or_else(|| {
                Error::Unsupported(format!(
                    "`{}` reads no images (send text, or serve a model that reads images)",
                    self.name
                ))
            })?;
            if request.suffix.is_some() || request.continue_final {
                return Err(Error::InvalidRequest(
                    "images are read in a chat turn, not with `suffix` or a continued message"
                        .into(),
                ));
            }
            let (marked, images) = vision.mark(&request.messages)?;
            let prompt = Prompt::new(g, "", (&marked, &request.tools), continuation, false)?;
            let (tokens, breakpoints) = prompt.tokens(g, &request.cache_breakpoints)?;
            if vision.is_cross() {
                let context = vision.context(&tokens, &images)?;
                return Ok(Prompted {
                    context: Some(context),
                    ..Prompted::tokens(tokens, Vec::new())
                });
            }
            let (tokens, breakpoints, images) = vision.expand(tokens, &images, breakpoints)?;
            return Ok(Prompted {
                images,
                ..Prompted::tokens(tokens, breakpoints)
            });
        }
        let text = match &request.suffix {
            ROption::RSome(suffix) => {
                if !request.messages.is_empty() {
                    return Err(Error::InvalidRequest(
                        "`suffix` needs a prompt, not chat messages".into(),
                    ));
                }
                crate::prompt::fill_in_the_middle(g, &request.prompt, suffix)?
            }
            ROption::RNone => request.prompt.to_string(),
        };
        let prompt = Prompt::new(
            g,
            &text,
            (&request.messages, &request.tools),
            continuation,
            request.continue_final,
        )?;
        let (tokens, breakpoints) = prompt.tokens(g, &request.cache_breakpoints)?;
        match &self.vision {
            Some(vision) => {
                let (tokens, breakpoints, _) = vision.expand(tokens, &[], breakpoints)?;
                Ok(Prompted::tokens(tokens, breakpoints))
            }
            None => Ok(Prompted::tokens(tokens, breakpoints)),
        }
    }

    /// `Save`: prefill the request's text (after checkpoint `source`, if set) and keep it.
    fn save(&self, r: &CheckpointRequest) -> Result<Vec<CheckpointInfo>> {
        if r.messages.iter().any(|m| !m.images.is_empty()) {
            return Err(Error::Unsupported(
                "a checkpoint save reads text; send images in a generation request (its \
                 `save_as` keeps them)"
                    .into(),
            ));
        }
        let source = (!r.source.is_empty()).then(|| r.source.to_string());
        let prompt = Prompt::new(
            self.generator(),
            &r.prompt,
            (&r.messages, ""),
            source.is_some(),
            false,
        )?;
        if prompt.is_empty() {
            return match source {
                Some(_) => self.fork(r),
                None => Err(Error::InvalidRequest(
                    "a checkpoint save needs a prompt, messages or a source checkpoint".into(),
                )),
            };
        }
        let (tokens, _) = prompt.tokens(self.generator(), &[])?;
        let spec = Spec {
            prompt: tokens,
            origin: match source {
                Some(name) => Origin::Checkpoint { name, tokens: None },
                None => Origin::Prefix,
            },
            options: GenerateOptions {
                max_tokens: 0,
                sampling: sampler::greedy(),
                stop: Vec::new(),
                ignore_eos: false,
            },
            breakpoints: Vec::new(),
            top_logprobs: None,
            save_as: Some(r.name.to_string()),
            logit_bias: Vec::new(),
            guide: None,
            prefix: self.sharing.key(&r.owner),
            adapters: Vec::new(),
            steer: Default::default(),
            soft_prompt: None,
            images: Vec::new(),
            context: None,
        };
        let out = self.run(spec, "", &mut |_| true)?;
        Ok(vec![CheckpointInfo {
            name: r.name.clone(),
            tokens: out.prompt_tokens as u64,
        }])
    }

    /// `Fork`: checkpoint `source` saved again as `name` (pages shared).
    fn fork(&self, r: &CheckpointRequest) -> Result<Vec<CheckpointInfo>> {
        let seq = Leased::load(self.cache(), &r.source)?;
        seq.save(&r.name)?;
        let mut known = self.scheduler.checkpoints();
        match known.get(r.source.as_str()).cloned() {
            Some(ids) => known.insert(r.name.to_string(), ids),
            None => known.remove(r.name.as_str()),
        };
        Ok(vec![CheckpointInfo {
            name: r.name.clone(),
            tokens: seq.len()?,
        }])
    }

    /// `Graft`: checkpoint `source` appended to checkpoint `target`, re-positioned by the model
    /// (RoPE keys re-rotated).
    fn graft(&self, r: &CheckpointRequest) -> Result<Vec<CheckpointInfo>> {
        let dst = Leased::load(self.cache(), &r.target)?;
        let src = Leased::load(self.cache(), &r.source)?;
        let count = src.len()?;
        self.generator()
            .model()
            .graft(dst.seq, src.seq, 0, count)
            .into_result()
            .map_err(|e| Error::plugin("model.graft", e))?;
        dst.save(&r.name)?;
        let mut known = self.scheduler.checkpoints();
        let ids = match (known.get(r.target.as_str()), known.get(r.source.as_str())) {
            (Some(a), Some(b)) => Some([a.as_slice(), b.as_slice()].concat()),
            _ => None,
        };
        match ids {
            Some(ids) => known.insert(r.name.to_string(), ids),
            None => known.remove(r.name.as_str()),
        };
        Ok(vec![CheckpointInfo {
            name: r.name.clone(),
            tokens: dst.len()?,
        }])
    }

    /// `List`: every checkpoint, with the tokens it holds (the cache knows, after a restart too).
    fn list(&self) -> Result<Vec<CheckpointInfo>> {
        let all = self
            .cache()
            .checkpoints()
            .into_result()
            .map_err(|e| Error::plugin("cache.checkpoints", e))?;
        Ok(all.into_iter().collect())
    }

    /// An [`ErrorKind::AlreadyExists`](u_sdk::ErrorKind::AlreadyExists) error if checkpoint
    /// `stored` exists (`shown`: its name as the client wrote it).
    fn refuse_existing(&self, stored: &str, shown: &str) -> std::result::Result<(), UError> {
        let names = self.cache().checkpoints().into_result()?;
        if names.iter().any(|c| c.name.as_str() == stored) {
            return Err(UError::already_exists(format!(
                "checkpoint `{shown}` exists: pass `overwrite: true` to replace it"
            )));
        }
        Ok(())
    }

    /// `Delete`: checkpoint `name` removed.
    fn delete(&self, r: &CheckpointRequest) -> Result<Vec<CheckpointInfo>> {
        self.cache()
            .delete_checkpoint(r.name.as_str().into())
            .into_result()
            .map_err(|e| Error::plugin("cache.delete_checkpoint", e))?;
        self.scheduler.checkpoints().remove(r.name.as_str());
        Ok(Vec::new())
    }
}

/// A cache sequence loaded from a checkpoint, released when dropped.
struct Leased {
    cache: KvCacheBox,
    seq: SeqId,
}

impl Drop for Leased {
    fn drop(&mut self) {
        // Fails only for an unknown sequence; nothing is left to do then.
        let _ = self.cache.release(self.seq);
    }
}

impl Leased {
    fn load(cache: KvCacheBox, name: &str) -> Result<Self> {
        let seq = cache
            .load_checkpoint(name.into())
            .into_result()
            .map_err(|e| Error::plugin("cache.load_checkpoint", e))?;
        Ok(Self { cache, seq })
    }

    fn len(&self) -> Result<u64> {
        self.cache
            .len(self.seq)
            .into_result()
            .map_err(|e| Error::plugin("cache.len", e))
    }

    fn save(&self, name: &str) -> Result<()> {
        self.cache
            .save_checkpoint(name.into(), self.seq)
            .into_result()
            .map_err(|e| Error::plugin("cache.save_checkpoint", e))
    }
}

impl Engine for EngineHandle {
    fn models(&self) -> RResult<RVec<RString>, UError> {
        let aliases = self.aliases.iter().map(String::as_str);
        let mut names: Vec<RString> = std::iter::once(&*self.name)
            .chain(aliases.clone().filter(|a| *a != u_sdk::ANY_MODEL))
            .map(RString::from)
            .collect();
        match self.generator().model().adapters().into_result() {
            Ok(held) => names.extend(held.into_iter().map(|a| a.name)),
            Err(e) => return RResult::RErr(e),
        }
        if aliases.clone().any(|a| a == u_sdk::ANY_MODEL) {
            names.push(u_sdk::ANY_MODEL.into());
        }
        RResult::ROk(names.into())
    }

    fn generate(
        &self,
        request: &GenerateRequest,
        mut sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError> {
        (|| {
            self.check_model(&request.model)?;
            let top_logprobs = match request.top_logprobs {
                ROption::RSome(n) if n > MAX_TOP_LOGPROBS => {
                    return Err(Error::InvalidRequest(format!(
                        "top_logprobs is {n}; at most {MAX_TOP_LOGPROBS} alternatives are reported"
                    ))
                    .into());
                }
                ROption::RSome(n) => Some(n as usize),
                ROption::RNone => None,
            };
            let adapters = self.adapters_of(request)?;
            let names: Vec<String> = adapters.iter().map(|(n, _)| n.clone()).collect();
            let _using = self.ledger.using(&names);
            let steer = self.extras.steer(&request.control_vectors)?;
            let soft_prompt = self.extras.soft_prompt(&request.soft_prompt)?;
            // KV computed under adapters or control vectors is found only by requests under
            // the same ones — the same loading of each adapter, should a name be reloaded.
            let mut keyed: Vec<(String, f32)> = adapters
                .iter()
                .map(|(n, s)| (format!("{n}\0{}", self.ledger.generation(n)), *s))
                .collect();
            keyed.extend(
                request
                    .control_vectors
                    .iter()
                    .filter(|c| c.strength != 0.0)
                    .map(|c| {
                        (
                            format!("\0control:{}:{}-{}", c.name, c.first_layer, c.last_layer),
                            c.strength,
                        )
                    }),
            );
            // Checkpoints saved under adapters live in a namespace of the owner and the
            // adapter set: resumed only under the same adapters.
            let owner = match adapters.is_empty() {
                true => Owner::new(&request.owner, false),
                false => Owner::new(&format!("{}\0adapters={adapters:?}", request.owner), false),
            };
            if let (Some(name), false) = (request.save_as.as_ref().into_option(), request.overwrite)
            {
                self.refuse_existing(&owner.stored(name)?, name)?;
            }
            let resume = match request.resume_from.as_ref().into_option() {
                Some(name) => Some(owner.stored(name)?),
                None => None,
            };
            let g = self.generator();
            let Prompted {
                tokens,
                breakpoints,
                images,
                context: cross_context,
            } = self.prompt_tokens(request, resume.is_some())?;
            if cross_context.is_some() && (resume.is_some() || request.save_as.is_some()) {
                return Err(Error::Unsupported(
                    "KV checkpoints of a cross-attention model's image requests are not kept \
                     (the image's keys and values live beside the sequence)"
                        .into(),
                )
                .into());
            }
            let context = g.config().context_length as usize;
            if !request.clamp_max_tokens
                && context > 0
                && resume.is_none()
                && tokens.len() + request.max_tokens as usize > context
            {
                return Err(Error::ContextExceeded {
                    prompt: tokens.len(),
                    max_tokens: request.max_tokens as usize,
                    context,
                }
                .into());
            }
            let vocab = g.config().vocab_size;
            if let Some(bad) = request.logit_bias.iter().find(|b| b.id >= vocab) {
                return Err(Error::TokenOutOfRange { id: bad.id, vocab }.into());
            }
            let guide = match &request.constraint {
                Constraint::None => None,
                c => g.grammars()?.compile(c)?,
            };
            let spec = Spec {
                prompt: tokens,
                origin: match resume {
                    Some(name) => Origin::Checkpoint { name, tokens: None },
                    // Soft-prompt rows come first: no cached prefix of tokens fits before them;
                    // a cross-attention context changes every position from the image on.
                    None if soft_prompt.is_some() || cross_context.is_some() => Origin::Fresh,
                    None => Origin::Prefix,
                },
                options: GenerateOptions {
                    max_tokens: request.max_tokens,
                    sampling: request.sampling.clone(),
                    stop: request.stop.iter().map(|s| s.to_string()).collect(),
                    ignore_eos: request.ignore_eos,
                },
                breakpoints,
                top_logprobs,
                save_as: match request.save_as.as_ref().into_option() {
                    Some(name) => Some(owner.stored(name)?),
                    None => None,
                },
                logit_bias: request.logit_bias.iter().map(|b| (b.id, b.bias)).collect(),
                guide,
                prefix: self
                    .sharing
                    .key(&request.owner)
                    .under(&keyed, &self.adapter_keys),
                adapters,
                steer,
                soft_prompt,
                images,
                context: cross_context.map(|rows| (rows, self.vision_token())),
            };
            let out = self.run(spec, &request.client, &mut |t| sink.token(t))?;
            Ok(GenerateSummary {
                prompt_tokens: out.prompt_tokens as u32,
                cached_tokens: out.cached_tokens as u32,
                cache_written_tokens: out.cache_written_tokens as u32,
                generated_tokens: out.tokens.len() as u32,
                tokens: RVec::from(out.tokens),
                finish: out.finish,
                stop_sequence: out.stop_sequence.map(RString::from).into(),
                prompt_ms: out.prompt_s * 1e3,
                generate_ms: out.decode_s * 1e3,
                draft_tokens: out.drafted as u32,
                accepted_tokens: out.accepted as u32,
            })
        })()
        .into()
    }

    fn stats(&self) -> RResult<EngineStats, UError> {
        let (kv_bytes, kv_capacity_bytes) = self
            .cache()
            .stats()
            .into_result()
            .map_or((0, 0), |s| (s.bytes, s.capacity_bytes));
        let model = self.generator().model();
        let resident = model.adapters().into_result().map_or(0, |a| a.len() as u32);
        RResult::ROk(EngineStats {
            kv_bytes,
            kv_capacity_bytes,
            resident_adapters: resident,
            model_counters: model.counters().into_result().unwrap_or_default(),
            image_cache_hits: self.vision.as_ref().map_or(0, |v| v.cache_hits()),
            device: self.device.as_ref().into(),
            ..self.scheduler.stats()
        })
    }

    fn flush_cache(&self, model: RStr<'_>) -> RResult<u64, UError> {
        (|| {
            self.check_model(model.as_str())?;
            let stats = self.scheduler.stats();
            if stats.running + stats.queued > 0 {
                return Err(UError::new(
                    u_sdk::ErrorKind::Busy,
                    format!(
                        "the cache was not flushed: {} requests are running and {} waiting",
                        stats.running, stats.queued
                    ),
                ));
            }
            self.cache().flush_prefixes().into_result()
        })()
        .into()
    }

    fn checkpoint(&self, request: &CheckpointRequest) -> RResult<RVec<CheckpointInfo>, UError> {
        (|| {
            self.check_model(&request.model)?;
            // The owner's names as stored, and back (see `owner`).
            let owner = Owner::new(&request.owner, request.admin);
            let r = CheckpointRequest {
                name: owner.stored(&request.name)?.into(),
                source: owner.stored(&request.source)?.into(),
                target: owner.stored(&request.target)?.into(),
                ..request.clone()
            };
            let writes = matches!(
                r.op,
                CheckpointOp::Save | CheckpointOp::Fork | CheckpointOp::Graft
            );
            if writes && !r.overwrite {
                self.refuse_existing(&r.name, &request.name)?;
            }
            let out = match r.op {
                CheckpointOp::Save => self.save(&r),
                CheckpointOp::Fork => self.fork(&r),
                CheckpointOp::Graft => self.graft(&r),
                CheckpointOp::List => self.list(),
                CheckpointOp::Delete => self.delete(&r),
            };
            Ok(out?
                .into_iter()
                .filter_map(|c| {
                    let name = owner.visible(&c.name)?;
                    Some(CheckpointInfo {
                        name: name.into(),
                        ..c
                    })
                })
                .collect())
        })()
        .into()
    }

    fn embed(&self, model: RStr<'_>, input: RStr<'_>) -> RResult<RVec<f32>, UError> {
        (|| {
            self.check_model(model.as_str())?;
            let tokens = self.generator().encode(input.as_str())?;
            Ok(self.embed_ids(&tokens)?)
        })()
        .into()
    }

    fn tokenize(&self, request: &TokenizeRequest) -> RResult<RVec<u32>, UError> {
        (|| {
            self.check_model(&request.model)?;
            let g = self.generator();
            // Images count as the positions they take (their ids are the images'
            // fingerprints, see `crate::images`), as a generation would run them.
            if let Some(vision) = &self.vision
                && request.messages.iter().any(|m| !m.images.is_empty())
            {
                let (marked, images) = vision.mark(&request.messages)?;
                let prompt = Prompt::new(g, "", (&marked, ""), false, false)?;
                let (tokens, _) = prompt.tokens(g, &[])?;
                return Ok(RVec::from(vision.expand(tokens, &images, Vec::new())?.0));
            }
            let prompt = Prompt::new(
                g,
                &request.prompt,
                (&request.messages, ""),
                false,
                request.continue_final,
            )?;
            let tokens = match request.add_special {
                true => g.encode(prompt.text())?,
                false => g.encode_continuation(prompt.text())?,
            };
            Ok(RVec::from(tokens))
        })()
        .into()
    }

    fn detokenize(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<u8>, UError> {
        (|| {
            self.check_model(model.as_str())?;
            let g = self.generator();
            let vocab = g.config().vocab_size;
            let mut bytes = Vec::new();
            for &id in tokens.iter() {
                if id >= vocab {
                    return Err(Error::TokenOutOfRange { id, vocab }.into());
                }
                bytes.extend(g.token_bytes(id)?);
            }
            Ok(RVec::from(bytes))
        })()
        .into()
    }

    fn embed_tokens(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<f32>, UError> {
        (|| {
            self.check_model(model.as_str())?;
            Ok(self.embed_ids(tokens.as_slice())?)
        })()
        .into()
    }

    fn embed_image(&self, model: RStr<'_>, _: RSlice<'_, u8>) -> RResult<RVec<f32>, UError> {
        (|| {
            self.check_model(model.as_str())?;
            Err(u_sdk::not_an_image_model(model.as_str()))
        })()
        .into()
    }

    fn load_adapter(&self, name: RStr<'_>, path: RStr<'_>) -> RResult<AdapterInfo, UError> {
        self.load_at_run_time(name.as_str(), path.as_str()).into()
    }

    fn unload_adapter(&self, name: RStr<'_>) -> RResult<bool, UError> {
        self.unload_at_run_time(name.as_str()).into()
    }
}
