//! Draft-model speculative decoding (Leviathan et al. 2023, *Fast Inference from Transformers
//! via Speculative Decoding*; Chen et al. 2023): a smaller decoder over the same vocabulary
//! (`[model] draft` of the deployment) proposes a request's next tokens greedily, and the served
//! model verifies them as it verifies prompt-lookup drafts — the request's last token and the
//! draft in one pass, the sampler keeping the prefix it agrees with. A greedy draft is certain
//! of its tokens, so the verifier's rejection sampling keeps the served model's distribution.
//!
//! The draft model runs one batched pass per drafted position over every drafting request.
//! Each request keeps a sequence in the draft model's own cache holding the tokens the draft
//! model has seen; after a verification the drafted tokens that were kept stay in it and the
//! rest are cut, so the next draft feeds only what is new (the sampled token, and a kept
//! draft's last token).

use crate::{Error, Result, sampler::argmax};
use abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{KvCacheBox, ModelBox, ModelKind, Output, Rows, Segment, SeqChunk, SeqId};

/// Tokens a request feeds the draft model per pass while catching up (its prompt, at first).
const CATCH_UP_CHUNK: usize = 512;

/// The draft model and its cache.
pub(crate) struct Drafter {
    model: ModelBox,
    cache: KvCacheBox,
    vocab: usize,
    context: usize,
}

/// A request's sequence in the draft model's cache, released with it.
pub(crate) struct DraftSeq {
    cache: KvCacheBox,
    seq: SeqId,
    /// Tokens of the request whose KV the sequence holds.
    seen: usize,
    /// Drafted tokens after those whose KV it holds too (all but the last of a draft).
    drafted: Vec<u32>,
}

impl Drop for DraftSeq {
    fn drop(&mut self) {
        // Releasing fails only for an unknown sequence; nothing is left to do then.
        let _ = self.cache.release(self.seq);
    }
}

/// One request's drafting this pass.
pub(crate) struct DraftJob<'a> {
    /// The request's tokens, the last one not yet run by the served model.
    pub tokens: &'a [u32],
    /// Its sequence in the draft model's cache (created on its first draft).
    pub state: &'a mut Option<DraftSeq>,
    /// Most tokens to draft.
    pub max: usize,
}

impl Drafter {
    /// Wires a built decoder as the draft model for a model of `vocab` tokens.
    pub(crate) fn new(model: ModelBox, vocab: u32) -> Result<Self> {
        let config = model
            .config()
            .into_result()
            .map_err(|e| Error::plugin("draft model.config", e))?;
        if config.kind != ModelKind::Decoder || config.vocab_size != vocab {
            return Err(Error::Unsupported(format!(
                "the draft model is a {:?} of {} tokens; drafting needs a decoder of {vocab}",
                config.kind, config.vocab_size
            )));
        }
        let cache = model
            .cache()
            .into_result()
            .map_err(|e| Error::plugin("draft model.cache", e))?
            .into_option()
            .ok_or_else(|| Error::Unsupported("the draft model keeps no KV cache".into()))?;
        Ok(Self {
            model,
            cache,
            vocab: vocab as usize,
            context: match config.context_length {
                0 => usize::MAX,
                n => n as usize,
            },
        })
    }

    /// Drafts up to `job.max` tokens for every job, greedily; a job's draft is shorter where
    /// the draft model's context ends. Returns the drafts in job order.
    pub(crate) fn propose(&self, jobs: &mut [DraftJob<'_>]) -> Result<Vec<Vec<u32>>> {
        // Cut what the last verification rejected, and see what each job must feed first.
        let mut feeds: Vec<Vec<u32>> = Vec::with_capacity(jobs.len());
        for job in jobs.iter_mut() {
            let room = self.context.saturating_sub(job.tokens.len());
            job.max = job.max.min(room);
            if job.state.is_none() {
                let seq = self
                    .cache
                    .create()
                    .into_result()
                    .map_err(|e| Error::plugin("draft cache.create", e))?;
                *job.state = Some(DraftSeq {
                    cache: self.cache.clone(),
                    seq,
                    seen: 0,
                    drafted: Vec::new(),
                });
            }
            let state = job.state.as_mut().expect("created above");
            let kept = state
                .drafted
                .iter()
                .zip(job.tokens.get(state.seen..).unwrap_or_default())
                .take_while(|(d, t)| d == t)
                .count();
            let valid = (state.seen + kept).min(job.tokens.len().saturating_sub(1));
            if valid < state.seen + state.drafted.len() {
                self.cache
                    .truncate(state.seq, valid as u64)
                    .into_result()
                    .map_err(|e| Error::plugin("draft cache.truncate", e))?;
            }
            state.seen = valid;
            state.drafted.clear();
            feeds.push(match job.max {
                0 => Vec::new(),
                _ => job.tokens[valid..].to_vec(),
            });
        }
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); jobs.len()];
        // Catch up in chunks; the last chunk's last row gives each job its first draft token.
        loop {
            let long: Vec<usize> = (0..jobs.len())
                .filter(|&i| feeds[i].len() > CATCH_UP_CHUNK)
                .collect();
            if long.is_empty() {
                break;
            }
            let inputs: Vec<Vec<u32>> = long
                .iter()
                .map(|&i| feeds[i].drain(..CATCH_UP_CHUNK).collect())
                .collect();
            let seqs: Vec<SeqId> = long.iter().map(|&i| seq_of(&jobs[i])).collect();
            self.pass(&seqs, &inputs, false)?;
            for &i in &long {
                jobs[i].state.as_mut().expect("created above").seen += CATCH_UP_CHUNK;
            }
        }
        let mut active: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].max > 0).collect();
        let mut inputs: Vec<Vec<u32>> = active
            .iter()
            .map(|&i| std::mem::take(&mut feeds[i]))
            .collect();
        while !active.is_empty() {
            let seqs: Vec<SeqId> = active.iter().map(|&i| seq_of(&jobs[i])).collect();
            let next = self.pass(&seqs, &inputs, true)?;
            for (&i, (input, token)) in active.iter().zip(inputs.iter().zip(next)) {
                let state = jobs[i].state.as_mut().expect("created above");
                match drafts[i].is_empty() {
                    true => state.seen += input.len(),
                    false => state.drafted.extend_from_slice(input),
                }
                drafts[i].push(token);
            }
            active.retain(|&i| drafts[i].len() < jobs[i].max);
            inputs = active
                .iter()
                .map(|&i| vec![drafts[i][drafts[i].len() - 1]])
                .collect();
        }
        Ok(drafts)
    }

    /// One forward pass of the draft model: `inputs[i]` appended to `seqs[i]`; with `logits`,
    /// each sequence's greedy next token.
    fn pass(&self, seqs: &[SeqId], inputs: &[Vec<u32>], logits: bool) -> Result<Vec<u32>> {
        let segments: Vec<[Segment<'_>; 1]> = inputs
            .iter()
            .map(|t| [Segment::Tokens(RSlice::from_slice(t))])
            .collect();
        let output = match logits {
            true => Output::Logits(Rows::Last),
            false => Output::Nothing,
        };
        let chunks: Vec<SeqChunk<'_>> = seqs
            .iter()
            .zip(&segments)
            .map(|(&seq, input)| SeqChunk::tokens(seq, input, output))
            .collect();
        let rows = if logits { seqs.len() } else { 0 };
        let mut out = vec![0f32; rows * self.vocab];
        self.model
            .forward(
                RSlice::from_slice(&chunks),
                RSliceMut::from_mut_slice(&mut out),
            )
            .into_result()
            .map_err(|e| Error::plugin("draft model.forward", e))?;
        Ok(out.chunks_exact(self.vocab.max(1)).map(argmax).collect())
    }
}

fn seq_of(job: &DraftJob<'_>) -> SeqId {
    job.state.as_ref().expect("created before any pass").seq
}
