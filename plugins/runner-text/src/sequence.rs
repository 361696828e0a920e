//! One request's life as a state machine, whoever drives it (the scheduler's batch or a
//! single-request [`crate::Generator`] call): a cache sequence to start from (empty, the deepest
//! cached prefix, or a checkpoint), prefill, sampling, streamed text, stop conditions, and what
//! is kept in the cache at the end.
//!
//! Positions vs ids: a sequence resumed from a checkpoint whose token ids the engine never saw
//! (saved by another process) holds `unknown` leading positions without ids; everything that
//! needs ids (prefix caching, penalties) then sees only the known tail.

use crate::extras::Steer;
use crate::images::{self, ImageSpan};
use crate::owner::PrefixKey;
use crate::{
    Error, GenerateOptions, Generator, Result,
    constraint::Guide,
    drafter::DraftSeq,
    logprobs::LogSoftmax,
    lookup::{self, Lookup},
    sampler::Sampler,
    stream::{StopCheck, StopMatcher, Utf8Stream},
};
use std::{collections::HashSet, sync::Arc, time::Instant};
use u_sdk::{FinishReason, KvCacheBox, Output, Rows, Segment, SeqId, TokenLogprob};

/// Where a sequence's KV starts from.
pub(crate) enum Origin {
    /// An empty sequence; nothing is shared with the prefix cache.
    Fresh,
    /// The deepest cached prefix of the prompt; prompt and output are cached for later requests.
    Prefix,
    /// A named checkpoint, and its token ids when the engine knows them.
    Checkpoint {
        /// The checkpoint.
        name: String,
        /// Its token ids, if known.
        tokens: Option<Vec<u32>>,
    },
}

/// Everything a request asks for, tokenized.
pub(crate) struct Spec {
    /// The prompt (after the checkpoint's tokens when resuming).
    pub prompt: Vec<u32>,
    /// Where the KV starts from.
    pub origin: Origin,
    /// Token budget, sampling, stop strings.
    pub options: GenerateOptions,
    /// Prompt token counts whose KV to keep in the prefix cache.
    pub breakpoints: Vec<usize>,
    /// Alternatives to report per token, if logprobs were asked for.
    pub top_logprobs: Option<usize>,
    /// Checkpoint to save the sequence as at the end.
    pub save_as: Option<String>,
    /// Added to these tokens' logits before sampling (ids checked against the vocabulary).
    pub logit_bias: Vec<(u32, f32)>,
    /// The compiled constraint the output must follow, if any.
    pub guide: Option<Guide>,
    /// How the prompt keys the prefix cache (whose prefixes it may reuse and feed); already
    /// keyed by the adapters too.
    pub prefix: PrefixKey,
    /// Low-rank adapters the sequence runs under, with their scales.
    pub adapters: Vec<(String, f32)>,
    /// Control vectors added after blocks, for every row it runs.
    pub steer: Steer,
    /// Soft-prompt rows that stand before the prompt (with [`Origin::Fresh`]).
    pub soft_prompt: Option<Arc<[f32]>>,
    /// Images in the prompt: their rows, and where they stand in [`Spec::prompt`] (whose ids
    /// there are the images' fingerprints, see [`crate::images`]).
    pub images: Vec<ImageSpan>,
    /// A cross-decoder's context (an image's rows, with [`Origin::Fresh`]) and the image token
    /// the pass that brings it must hold.
    pub context: Option<(Arc<[f32]>, u32)>,
}

/// A sequence's cross-attention context: the cache sequence its keys and values go to, the
/// rows (brought by the first pass), and the token that pass must reach.
struct Cross {
    kv: SeqId,
    rows: Arc<[f32]>,
    token: u32,
    sent: bool,
}

/// Text streamed for one generated token (`id: None`: held-back text flushed at the end).
pub(crate) struct Piece {
    /// The token, or `None` for the final flush.
    pub id: Option<u32>,
    /// The text it completes.
    pub text: String,
    /// Its log-probability, when asked for.
    pub logprob: Option<TokenLogprob>,
    /// The most likely alternatives, when asked for.
    pub top: Vec<TokenLogprob>,
}

/// How a finished request went.
pub(crate) struct Outcome {
    /// Prompt positions (checkpoint tokens included).
    pub prompt_tokens: usize,
    /// Prompt positions whose KV came from the cache.
    pub cached_tokens: usize,
    /// Prompt positions newly stored at breakpoints.
    pub cache_written_tokens: usize,
    /// Generated ids (an end-of-sequence id that ended generation excluded).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// The stop string that ended it, if one did.
    pub stop_sequence: Option<String>,
    /// Seconds of prefill.
    pub prompt_s: f64,
    /// Seconds of decoding.
    pub decode_s: f64,
    /// The checkpoint written and its token ids (`None` when some are unknown).
    pub saved: Option<(String, Option<Vec<u32>>)>,
    /// Tokens drafted by prompt lookup, and of those the ones kept.
    pub drafted: usize,
    /// See `drafted`.
    pub accepted: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Prefill,
    Decode,
    /// Finished, but generated tokens still need their KV (for `save_as`).
    Flush(FinishReason),
    Done(FinishReason),
}

/// A request being served.
pub(crate) struct Sequence {
    cache: KvCacheBox,
    seq: SeqId,
    share: bool,
    prefix: PrefixKey,
    unknown: usize,
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    cached: usize,
    breakpoints: Vec<usize>,
    written_to: usize,
    budget: usize,
    generated: usize,
    state: State,
    sampler: Sampler,
    eos: HashSet<u32>,
    utf8: Utf8Stream,
    stops: StopMatcher,
    top_logprobs: Option<usize>,
    save_as: Option<String>,
    logit_bias: Vec<(u32, f32)>,
    guide: Option<Guide>,
    adapters: Vec<(String, f32)>,
    steer: Steer,
    /// Soft-prompt rows not yet run: positions `0..unknown` of the sequence.
    soft_prompt: Option<Arc<[f32]>>,
    /// The prompt's images, at their positions in the sequence.
    images: Vec<ImageSpan>,
    /// A cross-decoder's context.
    cross: Option<Cross>,
    stop_sequence: Option<String>,
    outbox: Vec<Piece>,
    error: Option<Error>,
    started: Instant,
    prefilled: Option<Instant>,
    /// Prompt-lookup drafting and its counts.
    lookup: Lookup,
    /// This pass's input when it drafts: the last token, then the draft.
    drafted: Vec<u32>,
    /// Its sequence in the draft model's cache, when a draft model drafts.
    draft_seq: Option<DraftSeq>,
}

impl Drop for Sequence {
    fn drop(&mut self) {
        // Releasing fails only for an unknown sequence; nothing is left to do then.
        let _ = self.cache.release(self.seq);
        if let Some(c) = &self.cross {
            let _ = self.cache.release(c.kv);
        }
    }
}

impl Sequence {
    /// Validates `spec` and takes a cache sequence for it.
    pub(crate) fn admit(g: &Generator, spec: Spec) -> Result<Self> {
        let (vocab, hidden) = (g.config().vocab_size, g.config().hidden as usize);
        let in_image = |i: usize| {
            spec.images
                .iter()
                .any(|m| (m.start..m.start + m.len(hidden)).contains(&i))
        };
        if let Some((_, &bad)) = spec
            .prompt
            .iter()
            .enumerate()
            .find(|&(i, &t)| t >= vocab && !(images::is_image_id(t) && in_image(i)))
        {
            return Err(Error::TokenOutOfRange { id: bad, vocab });
        }
        if spec.prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let fresh = matches!(spec.origin, Origin::Fresh);
        let share = !fresh && spec.prefix != PrefixKey::Off;
        let cache = g.cache().clone();
        let plugin = |op| move |e| Error::plugin(op, e);
        let (seq, cached, unknown, mut tokens) = match spec.origin {
            Origin::Fresh => {
                let seq = cache
                    .create()
                    .into_result()
                    .map_err(plugin("cache.create"))?;
                (seq, 0, 0, Vec::new())
            }
            Origin::Prefix => match spec.prefix.of(&spec.prompt[..spec.prompt.len() - 1]) {
                // The last prompt token always runs, so that its logits exist.
                Some(head) => {
                    let m = cache
                        .lookup_prefix(head.as_slice().into())
                        .into_result()
                        .map_err(plugin("cache.lookup_prefix"))?;
                    (m.seq, m.matched as usize, 0, Vec::new())
                }
                None => {
                    let seq = cache
                        .create()
                        .into_result()
                        .map_err(plugin("cache.create"))?;
                    (seq, 0, 0, Vec::new())
                }
            },
            Origin::Checkpoint { name, tokens } => {
                let seq = cache
                    .load_checkpoint(name.as_str().into())
                    .into_result()
                    .map_err(plugin("cache.load_checkpoint"))?;
                let len = cache.len(seq).into_result();
                let len = match len {
                    Ok(n) => n as usize,
                    Err(e) => {
                        let _ = cache.release(seq);
                        return Err(Error::plugin("cache.len", e));
                    }
                };
                match tokens {
                    Some(t) if t.len() == len => (seq, len, 0, t),
                    _ => (seq, len, len, Vec::new()),
                }
            }
        };
        // A soft prompt's rows are the first positions, without token ids.
        let unknown = match &spec.soft_prompt {
            Some(rows) if fresh => rows.len() / (g.config().hidden as usize).max(1),
            Some(_) => {
                let _ = cache.release(seq);
                return Err(Error::InvalidRequest(
                    "a soft prompt starts a fresh sequence (not a checkpoint or a cached prefix)"
                        .into(),
                ));
            }
            None => unknown,
        };
        let base = unknown + tokens.len();
        let images = spec
            .images
            .into_iter()
            .map(|m| ImageSpan {
                start: base + m.start,
                ..m
            })
            .collect();
        let context = match g.config().context_length {
            0 => usize::MAX,
            n => n as usize,
        };
        tokens.extend_from_slice(&spec.prompt);
        let prompt_len = unknown + tokens.len();
        let mut breakpoints: Vec<usize> = spec
            .breakpoints
            .iter()
            .map(|&b| base + b)
            .filter(|&b| b > cached && b <= prompt_len)
            .collect();
        breakpoints.sort_unstable();
        breakpoints.dedup();
        let eos = match (g.tokenizer(), spec.options.ignore_eos) {
            (Some(_), false) => g.special().eos.iter().copied().collect(),
            _ => HashSet::new(),
        };
        let s = Self {
            share,
            prefix: spec.prefix,
            cache,
            seq,
            unknown,
            tokens,
            prompt_len,
            computed: cached,
            cached,
            breakpoints,
            written_to: cached,
            budget: (spec.options.max_tokens as usize).min(context.saturating_sub(prompt_len)),
            generated: 0,
            state: State::Prefill,
            sampler: Sampler::new(&spec.options.sampling),
            eos,
            utf8: Utf8Stream::default(),
            stops: StopMatcher::new(spec.options.stop.iter().cloned()),
            top_logprobs: spec.top_logprobs,
            save_as: spec.save_as,
            logit_bias: spec.logit_bias,
            guide: spec.guide,
            adapters: spec.adapters,
            steer: spec.steer,
            soft_prompt: spec.soft_prompt,
            images,
            cross: None,
            stop_sequence: None,
            outbox: Vec::new(),
            error: None,
            started: Instant::now(),
            prefilled: None,
            lookup: Lookup::default(),
            drafted: Vec::new(),
            draft_seq: None,
        };
        // Checked once `s` exists, so that dropping it releases the sequences.
        let mut s = s;
        if let Some((rows, token)) = spec.context {
            if !fresh {
                return Err(Error::InvalidRequest(
                    "a cross-attention context starts a fresh sequence".into(),
                ));
            }
            let kv = s
                .cache
                .create()
                .into_result()
                .map_err(plugin("cache.create"))?;
            s.cross = Some(Cross {
                kv,
                rows,
                token,
                sent: false,
            });
        }
        if prompt_len >= context {
            return Err(Error::ContextFull {
                prompt: prompt_len,
                context,
            });
        }
        Ok(s)
    }

    /// The names of the adapters it runs under.
    pub(crate) fn adapter_names(&self) -> Vec<String> {
        self.adapters.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The adapters it runs under, as the model interface names them.
    pub(crate) fn adapters(&self) -> Vec<u_sdk::AdapterScale<'_>> {
        self.adapters
            .iter()
            .map(|(name, scale)| u_sdk::AdapterScale {
                name: name.as_str().into(),
                scale: *scale,
            })
            .collect()
    }

    /// The control vectors of its rows, as the model interface takes them.
    pub(crate) fn steering(&self) -> Vec<u_sdk::Steering<'_>> {
        self.steer
            .entries
            .iter()
            .map(|(layer, strength, v)| u_sdk::Steering {
                first_layer: *layer,
                last_layer: *layer,
                strength: *strength,
                vector: v.as_ref().into(),
            })
            .collect()
    }

    /// The cross-attention context of the next pass: the rows until a pass has brought them,
    /// then none (the model keeps their keys and values under `kv`).
    pub(crate) fn cross_context(&self) -> Option<u_sdk::CrossContext<'_>> {
        self.cross.as_ref().map(|c| u_sdk::CrossContext {
            kv: c.kv,
            rows: match c.sent {
                true => (&[] as &[f32]).into(),
                false => c.rows.as_ref().into(),
            },
        })
    }

    /// The soft-prompt rows the next pass must run before its tokens, if not yet run.
    pub(crate) fn soft_rows(&self) -> Option<&[f32]> {
        self.soft_prompt
            .as_deref()
            .filter(|_| self.computed < self.unknown)
    }

    /// The cache sequence holding this request's KV.
    pub(crate) fn seq(&self) -> SeqId {
        self.seq
    }

    /// Whether the request needs another forward pass.
    pub(crate) fn is_done(&self) -> bool {
        matches!(self.state, State::Done(_))
    }

    /// Whether the request is still running its prompt (afterwards it takes one token per
    /// pass).
    pub(crate) fn is_prefilling(&self) -> bool {
        self.state == State::Prefill
    }

    /// Ends the request now (the client went away): no more tokens, no held-back text.
    pub(crate) fn cancel(&mut self) {
        if !self.is_done() {
            self.state = State::Done(FinishReason::Cancelled);
        }
    }

    /// Ends the request with `error`, reported by [`Sequence::close`]; nothing of it is kept.
    pub(crate) fn fail(&mut self, error: Error) {
        self.save_as = None;
        self.share = false;
        self.error.get_or_insert(error);
        self.state = State::Done(FinishReason::Cancelled);
    }

    /// Takes the request's constraint out while its next mask is computed beside a forward
    /// pass (see [`Sequence::put_guide`]); `None` when it has none or is done.
    pub(crate) fn take_guide(&mut self) -> Option<Guide> {
        match self.state {
            State::Prefill | State::Decode => self.guide.take(),
            State::Flush(_) | State::Done(_) => None,
        }
    }

    /// Gives back the constraint [`Sequence::take_guide`] took.
    pub(crate) fn put_guide(&mut self, guide: Guide) {
        self.guide = Some(guide);
    }

    /// The text produced since the last call.
    pub(crate) fn take_pieces(&mut self) -> Vec<Piece> {
        std::mem::take(&mut self.outbox)
    }

    /// Plans this pass's draft: how many tokens it may draft, up to `max` (0: none this
    /// pass), when the request decodes one token at a time unconstrained, has room for them
    /// and is not backing off after rejected drafts. Called before every pass, it also forgets
    /// the last pass's draft.
    pub(crate) fn plan_draft(&mut self, max: usize, context: usize) -> usize {
        self.drafted.clear();
        let pending = self.unknown + self.tokens.len() - self.computed;
        if self.state != State::Decode || self.guide.is_some() || pending != 1 || max == 0 {
            return 0;
        }
        let room = self
            .budget
            .saturating_sub(self.generated + 1)
            .min(context.saturating_sub(self.computed + 1));
        if room == 0 || !self.lookup.ready() {
            return 0;
        }
        max.min(room)
    }

    /// Drafts up to `max` tokens ([`Sequence::plan_draft`]) by prompt lookup.
    pub(crate) fn draft_by_lookup(&mut self, max: usize) {
        let draft = lookup::propose(&self.tokens, max);
        self.set_draft(draft);
    }

    /// What a draft model needs to draft for this request: its tokens and its sequence in the
    /// draft model's cache; `None` where positions are not all tokens (soft prompts, images),
    /// which a draft model does not read.
    pub(crate) fn draft_model_input(&mut self) -> Option<(&[u32], &mut Option<DraftSeq>)> {
        match self.unknown == 0 && self.images.is_empty() {
            true => Some((&self.tokens, &mut self.draft_seq)),
            false => None,
        }
    }

    /// Runs `draft` after the pending last token in the next pass.
    pub(crate) fn set_draft(&mut self, draft: Vec<u32>) {
        if !draft.is_empty() {
            self.drafted
                .push(*self.tokens.last().expect("one pending token"));
            self.drafted.extend(draft);
        }
    }

    /// Forgets the draft model's sequence (after the draft model failed).
    pub(crate) fn reset_draft_model(&mut self) {
        self.draft_seq = None;
    }

    /// The input this request runs in the next pass — soft-prompt rows not yet run, then at
    /// most `max` positions: tokens, and image rows where images stand — how many positions
    /// that is, and which logits it needs (no input when it is done).
    pub(crate) fn next_input(
        &self,
        max: usize,
        hidden: usize,
    ) -> (Vec<Segment<'_>>, usize, Output) {
        let (start, tokens, wanted) = self.next_chunk(max);
        let mut input = Vec::with_capacity(2);
        if tokens.is_empty() {
            return (input, 0, wanted);
        }
        if let Some(rows) = self.soft_rows() {
            input.push(Segment::Embeddings(rows.into()));
        }
        if self.drafted.is_empty() && !self.images.is_empty() {
            input.extend(images::segments(start, tokens, &self.images, hidden));
        } else {
            input.push(Segment::Tokens(tokens.into()));
        }
        (input, tokens.len(), wanted)
    }

    /// The position of the first token this request runs in the next pass, the tokens (at
    /// most `max`), and which logits it needs (empty when it is done).
    fn next_chunk(&self, max: usize) -> (usize, &[u32], Output) {
        if !self.drafted.is_empty() {
            return (self.computed, &self.drafted, Output::Logits(Rows::All));
        }
        let (target, logits) = match self.state {
            State::Prefill => (self.prompt_len, Output::Logits(Rows::Last)),
            State::Decode => (self.unknown + self.tokens.len(), Output::Logits(Rows::Last)),
            State::Flush(_) => (self.unknown + self.tokens.len(), Output::Nothing),
            State::Done(_) => return (0, &[], Output::Nothing),
        };
        // Positions before `unknown` without a pending soft prompt are already computed; with
        // one, its rows run in the same pass as the first tokens.
        let first = self.computed.max(self.unknown);
        let mut end = target.min(first.saturating_add(max.max(1)));
        // The pass that brings a cross-attention context holds its image token.
        if let Some(c) = self.cross.as_ref().filter(|c| !c.sent)
            && let Some(p) = self.tokens.iter().position(|&t| t == c.token)
        {
            end = end.max((self.unknown + p + 1).min(target));
        }
        let logits = if end == target {
            logits
        } else {
            Output::Nothing
        };
        let tokens = &self.tokens[first - self.unknown..end - self.unknown];
        (first, tokens, logits)
    }

    /// Records that the last pass ran `n` of this request's tokens; `logits` holds the rows it
    /// asked for, if any (one, or one per token of a draft pass).
    pub(crate) fn advance(
        &mut self,
        g: &Generator,
        n: usize,
        logits: Option<&mut [f32]>,
    ) -> Result<()> {
        if !self.drafted.is_empty() {
            return self.verify(g, logits.unwrap_or_default());
        }
        if let Some(c) = &mut self.cross {
            c.sent = true;
        }
        if self.soft_rows().is_some() {
            self.computed = self.unknown;
        }
        self.computed += n;
        while let Some(&b) = self.breakpoints.first()
            && b <= self.computed
        {
            self.breakpoints.remove(0);
            self.insert_prefix(b)?;
            self.written_to = b;
        }
        match self.state {
            State::Prefill if self.computed == self.prompt_len => {
                self.prefilled = Some(Instant::now());
                self.state = State::Decode;
                self.insert_prefix(self.prompt_len)?;
            }
            State::Flush(reason) if self.computed == self.unknown + self.tokens.len() => {
                self.state = State::Done(reason);
            }
            _ => {}
        }
        if let (State::Decode, Some(logits)) = (self.state, logits) {
            self.decode(g, logits, None)?;
        }
        Ok(())
    }

    /// Takes the tokens of a draft pass: row `i` of `logits` follows the `i`-th token of the
    /// pass, so each row picks the next token, checked against the draft, until the sampler
    /// disagrees (its token stands instead) or the request ends; the KV of the rejected rest
    /// is dropped.
    fn verify(&mut self, g: &Generator, logits: &mut [f32]) -> Result<()> {
        let draft = std::mem::take(&mut self.drafted);
        let vocab = g.config().vocab_size as usize;
        let mut kept = 0;
        for (i, row) in logits.chunks_exact_mut(vocab.max(1)).enumerate() {
            let proposed = draft.get(i + 1).copied();
            let picked = self.decode(g, row, proposed)?;
            match (picked, proposed) {
                (Some(t), Some(d)) if t == d && self.state == State::Decode => kept += 1,
                _ => break,
            }
        }
        self.lookup.record(draft.len() - 1, kept);
        self.computed += 1 + kept;
        if 1 + kept < draft.len() {
            self.cache
                .truncate(self.seq, self.computed as u64)
                .into_result()
                .map_err(|e| Error::plugin("cache.truncate", e))?;
        }
        if let State::Flush(reason) = self.state
            && self.computed == self.unknown + self.tokens.len()
        {
            self.state = State::Done(reason);
        }
        Ok(())
    }

    /// Samples the next token from `logits` (checked against `draft` when a draft proposed
    /// one) and streams its text; the token taken, if generation went on.
    fn decode(
        &mut self,
        g: &Generator,
        logits: &mut [f32],
        draft: Option<u32>,
    ) -> Result<Option<u32>> {
        if self.generated >= self.budget {
            self.finish(FinishReason::Length);
            return Ok(None);
        }
        // Log-probabilities come from the raw logits, before the sampler's penalties.
        let ranked = self
            .top_logprobs
            .map(|n| (LogSoftmax::new(logits, n), logits.to_vec()));
        // OpenAI's -100 is a ban: the token can never be drawn, however large its logit.
        for &(token, bias) in &self.logit_bias {
            if let Some(l) = logits.get_mut(token as usize) {
                *l = if bias <= -100.0 {
                    f32::NEG_INFINITY
                } else {
                    *l + bias
                };
            }
        }
        if let Some(guide) = &mut self.guide
            && !guide.apply(logits)?
        {
            self.finish(FinishReason::Stop);
            return Ok(None);
        }
        let id = match draft {
            Some(d) => self.sampler.verify(logits, &self.tokens, d),
            None => self.sampler.sample(logits, &self.tokens),
        };
        if self.eos.contains(&id) {
            self.finish(FinishReason::Stop);
            return Ok(None);
        }
        let complete = match &mut self.guide {
            Some(guide) => guide.commit(id)?,
            None => false,
        };
        self.tokens.push(id);
        self.generated += 1;
        let bytes = g.token_bytes(id)?;
        let (text, stopped) = match self.stops.push(&self.utf8.push(&bytes)) {
            StopCheck::Emit(text) => (text, None),
            StopCheck::Stop(text, stop) => (text, Some(stop)),
        };
        let (logprob, top) = match ranked {
            Some((r, raw)) => {
                let entry = |id: u32, logprob: f32| -> Result<TokenLogprob> {
                    Ok(TokenLogprob {
                        id,
                        bytes: g.token_bytes(id)?.into(),
                        logprob,
                    })
                };
                let top = r
                    .top()
                    .iter()
                    .map(|&(i, lp)| entry(i, lp))
                    .collect::<Result<_>>()?;
                (Some(entry(id, r.of(raw[id as usize]))?), top)
            }
            None => (None, Vec::new()),
        };
        self.outbox.push(Piece {
            id: Some(id),
            text,
            logprob,
            top,
        });
        if let Some(stop) = stopped {
            self.stop_sequence = Some(stop);
            self.end(FinishReason::Stop);
        } else if complete {
            self.finish(FinishReason::Stop);
        } else if self.generated >= self.budget {
            self.finish(FinishReason::Length);
        }
        Ok(Some(id))
    }

    /// Ends generation without a stop string so far: flushes the held-back text first (which
    /// may still complete one).
    fn finish(&mut self, mut reason: FinishReason) {
        let tail = match self.stops.push(&self.utf8.finish()) {
            StopCheck::Emit(s) => s + &self.stops.finish(),
            StopCheck::Stop(s, stop) => {
                self.stop_sequence = Some(stop);
                reason = FinishReason::Stop;
                s
            }
        };
        if !tail.is_empty() {
            self.outbox.push(Piece {
                id: None,
                text: tail,
                logprob: None,
                top: Vec::new(),
            });
        }
        self.end(reason);
    }

    fn end(&mut self, reason: FinishReason) {
        let pending = self.unknown + self.tokens.len() > self.computed;
        self.state = if self.save_as.is_some() && pending {
            State::Flush(reason)
        } else {
            State::Done(reason)
        };
    }

    /// Records the first `len` positions in the prefix cache (when this request shares, and
    /// every id is known).
    fn insert_prefix(&self, len: usize) -> Result<()> {
        if !self.share || self.unknown > 0 || len == 0 {
            return Ok(());
        }
        let Some(key) = self.prefix.of(&self.tokens[..len]) else {
            return Ok(());
        };
        self.cache
            .insert_prefix(key.as_slice().into(), self.seq)
            .into_result()
            .map_err(|e| Error::plugin("cache.insert_prefix", e))
    }

    /// Keeps what the request computed (prefix cache, checkpoint) and releases its sequence.
    pub(crate) fn close(mut self) -> Result<Outcome> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let finish = match self.state {
            State::Done(r) | State::Flush(r) => r,
            State::Prefill | State::Decode => FinishReason::Cancelled,
        };
        self.insert_prefix(self.computed)?;
        let saved = match (&self.save_as, finish) {
            (Some(name), FinishReason::Stop | FinishReason::Length) => {
                self.cache
                    .save_checkpoint(name.as_str().into(), self.seq)
                    .into_result()
                    .map_err(|e| Error::plugin("cache.save_checkpoint", e))?;
                let ids = (self.unknown == 0).then(|| self.tokens.clone());
                Some((name.clone(), ids))
            }
            _ => None,
        };
        let now = Instant::now();
        let prefilled = self.prefilled.unwrap_or(now);
        Ok(Outcome {
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached,
            cache_written_tokens: self.written_to - self.cached,
            tokens: self.tokens[self.prompt_len - self.unknown..].to_vec(),
            finish,
            stop_sequence: self.stop_sequence.clone(),
            prompt_s: (prefilled - self.started).as_secs_f64(),
            decode_s: (now - prefilled).as_secs_f64(),
            saved,
            drafted: self.lookup.drafted,
            accepted: self.lookup.accepted,
        })
    }
}
