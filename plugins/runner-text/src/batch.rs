//! One forward pass for many requests: every running request contributes a chunk — a decoding
//! one its last token, a prefilling one as much of its prompt as the step's token budget leaves
//! (oldest first), so long prompts never stall the decodes running beside them.
//!
//! A decoding request may run a draft after its last token while the pass carries few decodes:
//! the draft model's (see [`crate::drafter`]) where the deployment has one, else a prompt
//! lookup (see [`crate::lookup`]).
//!
//! Constrained requests' next-token masks are computed on a worker thread while the forward
//! pass runs (llguidance's mask takes about as long as a small model's decode step), so a
//! batch that mixes constrained and free requests waits for neither in turn.

use crate::{
    Error, Generator, Result,
    constraint::Guide,
    drafter::{DraftJob, Drafter},
    sequence::Sequence,
};
use abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{AdapterScale, Output, Rows, SeqChunk, SeqExtras, Steering};

/// Running requests, each with the driver's tag `T` (where its output goes).
pub(crate) struct Batch<T> {
    slots: Vec<(Sequence, T)>,
    step_tokens: usize,
    logits: Vec<f32>,
}

impl<T> Batch<T> {
    /// An empty batch whose passes carry about `step_tokens` tokens (decodes first).
    pub(crate) fn new(step_tokens: usize) -> Self {
        Self {
            slots: Vec::new(),
            step_tokens: step_tokens.max(1),
            logits: Vec::new(),
        }
    }

    /// Adds a request; it joins the next pass.
    pub(crate) fn push(&mut self, seq: Sequence, tag: T) {
        self.slots.push((seq, tag));
    }

    /// Requests in the batch.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no request is running.
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The running requests and their tags.
    pub(crate) fn slots_mut(&mut self) -> impl Iterator<Item = &mut (Sequence, T)> {
        self.slots.iter_mut()
    }

    /// Removes and returns the requests that need no more passes.
    pub(crate) fn take_done(&mut self) -> Vec<(Sequence, T)> {
        self.slots.extract_if(.., |(s, _)| s.is_done()).collect()
    }

    /// Runs one forward pass over every request that has work and feeds each its logits;
    /// returns whether a pass ran. A request whose bookkeeping fails afterwards is failed alone;
    /// when the pass itself fails no request advanced (the model rolled their KV back).
    pub(crate) fn step(&mut self, g: &Generator) -> Result<bool> {
        let Self {
            slots,
            step_tokens,
            logits,
        } = self;
        // Taken out so that the worker may fill their masks while `chunks` borrows the slots.
        let mut guides: Vec<(usize, Guide)> = slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, (s, _))| s.take_guide().map(|g| (i, g)))
            .collect();
        let decoding = slots
            .iter()
            .filter(|(s, _)| !s.is_done() && !s.is_prefilling())
            .count();
        // Drafts pay while the pass is small: decode reads every weight once whatever its rows.
        let draft = match decoding <= g.speculation().max_running {
            true => g.speculation().draft_tokens,
            false => 0,
        };
        let context = match g.config().context_length {
            0 => usize::MAX,
            n => n as usize,
        };
        match g.drafter() {
            Some(drafter) => draft_with_model(drafter, slots, draft, context),
            None => {
                for (s, _) in slots.iter_mut() {
                    match s.plan_draft(draft, context) {
                        0 => {}
                        max => s.draft_by_lookup(max),
                    }
                }
            }
        }
        let hidden = g.config().hidden as usize;
        let mut prefill_left = step_tokens.saturating_sub(decoding).max(1);
        let mut plan = Vec::with_capacity(slots.len());
        let mut inputs = Vec::with_capacity(slots.len());
        for (i, (s, _)) in slots.iter().enumerate() {
            let max = match s.is_prefilling() {
                true if prefill_left == 0 => continue,
                true => prefill_left,
                false => usize::MAX,
            };
            let (input, n, wanted) = s.next_input(max, hidden);
            if n == 0 {
                continue;
            }
            if s.is_prefilling() {
                prefill_left -= n;
            }
            plan.push((i, n, wanted != Output::Nothing, wanted));
            inputs.push(input);
        }
        if plan.is_empty() {
            for (i, guide) in guides {
                slots[i].0.put_guide(guide);
            }
            return Ok(false);
        }
        let adapters: Vec<Vec<AdapterScale<'_>>> =
            plan.iter().map(|&(i, ..)| slots[i].0.adapters()).collect();
        let steering: Vec<Vec<Steering<'_>>> =
            plan.iter().map(|&(i, ..)| slots[i].0.steering()).collect();
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .zip(&inputs)
            .zip(adapters.iter().zip(&steering))
            .map(
                |((&(i, _, _, wanted), input), (adapters, steering))| SeqChunk {
                    extras: SeqExtras {
                        adapters: RSlice::from_slice(adapters),
                        steering: RSlice::from_slice(steering),
                        cross: slots[i].0.cross_context().into(),
                        ..SeqExtras::default()
                    },
                    ..SeqChunk::tokens(slots[i].0.seq(), input, wanted)
                },
            )
            .collect();
        let vocab = g.config().vocab_size as usize;
        let rows_of = |n: usize, wanted: Output| match wanted {
            Output::Logits(Rows::All) => n,
            Output::Nothing => 0,
            _ => 1,
        };
        let rows: usize = plan.iter().map(|&(_, n, _, w)| rows_of(n, w)).sum();
        logits.resize(rows * vocab, 0.0);
        let mut forward = || {
            g.model()
                .forward(
                    RSlice::from_slice(&chunks),
                    RSliceMut::from_mut_slice(logits),
                )
                .into_result()
                .map_err(|e| Error::plugin("model.forward", e))
        };
        let ran = match guides.is_empty() {
            true => forward(),
            false => std::thread::scope(|scope| {
                let worker = std::thread::Builder::new()
                    .name("u-engine-masks".into())
                    .spawn_scoped(scope, || guides.iter_mut().for_each(|(_, g)| g.prepare()));
                let ran = forward();
                // A worker that could not start or panicked leaves masks unset;
                // `Guide::apply` computes them then.
                if let Ok(worker) = worker {
                    let _ = worker.join();
                }
                ran
            }),
        };
        drop(chunks);
        for (i, guide) in guides {
            slots[i].0.put_guide(guide);
        }
        ran?;
        let mut rest: &mut [f32] = logits;
        for (i, n, wants, wanted) in plan {
            let (mine, after) = std::mem::take(&mut rest).split_at_mut(rows_of(n, wanted) * vocab);
            rest = after;
            let s = &mut slots[i].0;
            if let Err(e) = s.advance(g, n, wants.then_some(mine)) {
                s.fail(e);
            }
        }
        Ok(true)
    }
}

/// Plans every request's draft (at most `draft` tokens within `context`) and drafts for those
/// that may with the draft model, in batched passes. A request whose positions a draft model
/// cannot read drafts nothing; if the draft model fails, this pass drafts nothing and the
/// requests start their draft sequences afresh (drafts only speed decoding up: the served model
/// decides every token either way).
fn draft_with_model<T>(
    drafter: &Drafter,
    slots: &mut [(Sequence, T)],
    draft: usize,
    context: usize,
) {
    let mut order = Vec::with_capacity(slots.len());
    let mut jobs = Vec::with_capacity(slots.len());
    for (slot, (s, _)) in slots.iter_mut().enumerate() {
        let max = s.plan_draft(draft, context);
        if max == 0 {
            continue;
        }
        if let Some((tokens, state)) = s.draft_model_input() {
            order.push(slot);
            jobs.push(DraftJob { tokens, state, max });
        }
    }
    let drafts = drafter.propose(&mut jobs);
    drop(jobs);
    match drafts {
        Ok(drafts) => {
            for (slot, draft) in order.into_iter().zip(drafts) {
                slots[slot].0.set_draft(draft);
            }
        }
        Err(_) => {
            for slot in order {
                slots[slot].0.reset_draft_model();
            }
        }
    }
}
