//! Decoding one 30 s window: the prompt, then one token per pass under openai-whisper's logit
//! rules (suppressed tokens, no blank start, timestamp grammar), greedy or sampled.

use crate::vocab::{Specials, TIME_PRECISION};
use abi_stable::std_types::{ROption, RSlice, RSliceMut};
use u_sdk::{
    CrossContext, ErrorKind, KvCacheBox, ModelBox, Output, Result, Rows, Segment, SeqChunk,
    SeqExtras, SeqId, UError,
};

/// What a window decoder needs besides the audio.
pub struct Decoder<'a> {
    /// The model.
    pub model: &'a ModelBox,
    /// Its cache (sequences are created and released here).
    pub cache: &'a KvCacheBox,
    /// Token ids of the vocabulary.
    pub vocab: usize,
    /// The special tokens.
    pub specials: &'a Specials,
    /// Suppressed at every step.
    pub suppress: &'a [u32],
    /// Suppressed at the first step (a space, the end token): a transcript does not start
    /// blank.
    pub suppress_blank: &'a [u32],
    /// Most tokens a window may add.
    pub sample_len: usize,
    /// Beams of a greedy (temperature 0) window; 1 decodes greedily.
    pub beam_size: usize,
    /// Positions the decoder holds: a window stops sampling when its prompt and tokens fill
    /// them.
    pub context: usize,
}

/// How one window decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The tokens after the prompt, the end token left out.
    pub tokens: Vec<u32>,
    /// Sum of the chosen tokens' log-probabilities, the end token's included.
    pub sum_logprob: f64,
    /// The no-speech token's probability at the first position of the transcript.
    pub no_speech_prob: f64,
    /// The temperature decoded at.
    pub temperature: f32,
}

impl Decoded {
    /// `sum_logprob / (tokens + 1)`, as openai-whisper averages.
    pub fn avg_logprob(&self) -> f64 {
        self.sum_logprob / (self.tokens.len() + 1) as f64
    }
}

/// A small deterministic generator for sampling at a temperature (xorshift64*).
pub struct Rng(u64);

impl Rng {
    /// Seeded; a zero seed is moved off zero.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn chunk<'a>(
    seq: SeqId,
    input: &'a [Segment<'a>],
    kv: SeqId,
    mel: &'a [f32],
    output: Output,
) -> SeqChunk<'a> {
    SeqChunk {
        seq,
        input: RSlice::from_slice(input),
        output,
        extras: SeqExtras {
            cross: ROption::RSome(CrossContext {
                kv,
                rows: RSlice::from_slice(mel),
            }),
            ..SeqExtras::default()
        },
    }
}

impl Decoder<'_> {
    /// Runs `tokens` for `seq` over the audio of `kv` (bringing `mel` when it is not yet
    /// encoded) and returns the logits of every row or the last.
    pub fn pass(
        &self,
        seq: SeqId,
        tokens: &[u32],
        kv: SeqId,
        mel: &[f32],
        rows: Rows,
    ) -> Result<Vec<f32>> {
        let input = [Segment::Tokens(RSlice::from_slice(tokens))];
        let n = match rows {
            Rows::All => tokens.len(),
            Rows::Last => 1,
        };
        let mut out = vec![0f32; n * self.vocab];
        let batch = [chunk(seq, &input, kv, mel, Output::Logits(rows))];
        self.model
            .forward(
                RSlice::from_slice(&batch),
                RSliceMut::from_mut_slice(&mut out),
            )
            .into_result()?;
        Ok(out)
    }

    /// Decodes one window: `prompt` (ending in the transcript's start sequence), then tokens
    /// until the end token or `sample_len`, over the audio in `kv` (encoding `mel` first when
    /// given). With `timestamps`, the timestamp grammar applies.
    pub fn window(
        &self,
        prompt: &[u32],
        kv: SeqId,
        mel: &[f32],
        timestamps: bool,
        temperature: f32,
        rng: &mut Rng,
    ) -> Result<Decoded> {
        let seq = self.cache.create().into_result()?;
        let result = if temperature == 0.0 && self.beam_size > 1 {
            self.beam_search(seq, prompt, kv, mel, timestamps)
        } else {
            self.window_in(seq, prompt, kv, mel, timestamps, temperature, rng)
        };
        let _ = self.cache.release(seq);
        result
    }

    /// Most tokens a window after `prompt` may add: `sample_len`, or fewer where the prompt
    /// and they would not fit the decoder's positions (the last one is never run).
    fn limit(&self, prompt: &[u32]) -> usize {
        self.sample_len
            .min((self.context + 1).saturating_sub(prompt.len()))
            .max(1)
    }

    /// The prompt's pass: the no-speech probability (at the `sot` row) and the logits of its
    /// last row. The prompt runs in two chunks (up to `sot`, then the rest) so that only two
    /// rows of logits are computed however long the previous text is.
    fn prompt_pass(
        &self,
        seq: SeqId,
        prompt: &[u32],
        kv: SeqId,
        mel: &[f32],
    ) -> Result<(f64, Vec<f32>)> {
        let s = self.specials;
        if prompt.is_empty() {
            return Err(UError::invalid("runner-transcription: an empty prompt"));
        }
        let sot_row = prompt.iter().rposition(|&t| t == s.sot).unwrap_or(0);
        let first = self.pass(seq, &prompt[..=sot_row], kv, mel, Rows::Last)?;
        let no_speech_prob = softmax_at(&first, s.no_speech as usize);
        let logits = match &prompt[sot_row + 1..] {
            [] => first,
            rest => self.pass(seq, rest, kv, &[], Rows::Last)?,
        };
        Ok((no_speech_prob, logits))
    }

    /// One token for each of `beams` (sequence, token) in one batched pass: each one's logits.
    fn step(&self, beams: &[(SeqId, u32)], kv: SeqId) -> Result<Vec<Vec<f32>>> {
        let inputs: Vec<[Segment<'_>; 1]> = beams
            .iter()
            .map(|(_, t)| [Segment::Tokens(RSlice::from_slice(std::slice::from_ref(t)))])
            .collect();
        let batch: Vec<SeqChunk<'_>> = beams
            .iter()
            .zip(&inputs)
            .map(|((seq, _), input)| chunk(*seq, input, kv, &[], Output::Logits(Rows::Last)))
            .collect();
        let mut out = vec![0f32; beams.len() * self.vocab];
        self.model
            .forward(
                RSlice::from_slice(&batch),
                RSliceMut::from_mut_slice(&mut out),
            )
            .into_result()?;
        Ok(out.chunks_exact(self.vocab).map(<[f32]>::to_vec).collect())
    }

    /// Beam search as openai-whisper's `BeamSearchDecoder` (patience 1) and
    /// `MaximumLikelihoodRanker` (no length penalty) do it: every beam proposes its
    /// `beam_size + 1` likeliest tokens, the `beam_size` best unfinished continuations go on
    /// (forked sequences sharing their KV pages), until `beam_size` sequences have ended; the
    /// one with the best mean log-probability wins.
    fn beam_search(
        &self,
        seq: SeqId,
        prompt: &[u32],
        kv: SeqId,
        mel: &[f32],
        timestamps: bool,
    ) -> Result<Decoded> {
        let mut live: Vec<SeqId> = Vec::new();
        let result = self.beam_search_in(seq, prompt, kv, mel, timestamps, &mut live);
        for s in live {
            let _ = self.cache.release(s);
        }
        result
    }

    fn beam_search_in(
        &self,
        seq: SeqId,
        prompt: &[u32],
        kv: SeqId,
        mel: &[f32],
        timestamps: bool,
        live: &mut Vec<SeqId>,
    ) -> Result<Decoded> {
        let (eot, width) = (self.specials.eot, self.beam_size);
        let (no_speech_prob, first) = self.prompt_pass(seq, prompt, kv, mel)?;
        // (sequence, tokens after the prompt, sum of log-probabilities), and each one's logits.
        let mut beams: Vec<(SeqId, Vec<u32>, f64)> = vec![(seq, Vec::new(), 0.0)];
        let mut logits = vec![first];
        let mut finished: Vec<(Vec<u32>, f64)> = Vec::new();
        let limit = self.limit(prompt);
        for step in 0..limit {
            // Candidates in the order openai-whisper's dict holds them: a sequence proposed
            // twice keeps its first place, its score and source from the last proposal.
            let mut candidates: Vec<(Vec<u32>, f64, usize)> = Vec::new();
            for (b, (_, tokens, sum)) in beams.iter().enumerate() {
                let mut l = logits[b].clone();
                self.filter(&mut l, tokens, timestamps);
                let logprobs = log_softmax(&l);
                // Beams are distinct sequences, so their continuations are too (openai-whisper
                // starts from copies of one beam and merges their equal proposals; one beam
                // proposing once is the same).
                for t in top_k(&logprobs, width + 1) {
                    let mut next = tokens.clone();
                    next.push(t);
                    candidates.push((next, sum + f64::from(logprobs[t as usize]), b));
                }
            }
            candidates.sort_by(|a, b| b.1.total_cmp(&a.1));
            let mut next_beams = Vec::new();
            let mut newly = Vec::new();
            for (tokens, score, source) in candidates {
                if tokens.last() == Some(&eot) {
                    newly.push((tokens, score));
                } else {
                    next_beams.push((tokens, score, source));
                    if next_beams.len() == width {
                        break;
                    }
                }
            }
            for f in newly {
                if finished.len() >= width {
                    break;
                }
                if !finished.iter().any(|(t, _)| *t == f.0) {
                    finished.push(f);
                }
            }
            if finished.len() >= width || next_beams.is_empty() || step + 1 == limit {
                if finished.len() < width {
                    beams = next_beams
                        .into_iter()
                        .map(|(tokens, score, source)| (beams[source].0, tokens, score))
                        .collect();
                }
                break;
            }
            // Each continuation forks its source's KV; the old sequences go.
            let mut forked = Vec::with_capacity(next_beams.len());
            for (tokens, score, source) in next_beams {
                let s = self.cache.fork(beams[source].0).into_result()?;
                live.push(s);
                forked.push((s, tokens, score));
            }
            for (old, _, _) in &beams {
                if let Some(i) = live.iter().position(|s| s == old) {
                    live.swap_remove(i);
                    let _ = self.cache.release(*old);
                }
            }
            beams = forked;
            let step: Vec<(SeqId, u32)> =
                beams.iter().map(|(s, t, _)| (*s, t[t.len() - 1])).collect();
            logits = self.step(&step, kv)?;
        }
        // Too few ended: the likeliest unfinished beams end here.
        let mut order: Vec<usize> = (0..beams.len()).collect();
        order.sort_by(|&a, &b| beams[b].2.total_cmp(&beams[a].2).then(b.cmp(&a)));
        for i in order {
            if finished.len() >= width {
                break;
            }
            let mut tokens = beams[i].1.clone();
            tokens.push(eot);
            if !finished.iter().any(|(t, _)| *t == tokens) {
                finished.push((tokens, beams[i].2));
            }
        }
        let text_len = |t: &[u32]| t.iter().position(|&x| x == eot).unwrap_or(t.len());
        let mut best: Option<(f64, usize)> = None;
        for (i, (tokens, sum)) in finished.iter().enumerate() {
            let score = sum / text_len(tokens).max(1) as f64;
            if best.is_none_or(|(b, _)| score > b) {
                best = Some((score, i));
            }
        }
        let (tokens, sum_logprob) =
            best.map(|(_, i)| finished.swap_remove(i)).ok_or_else(|| {
                UError::new(ErrorKind::Internal, "runner-transcription: no beam ended")
            })?;
        Ok(Decoded {
            tokens: tokens[..text_len(&tokens)].to_vec(),
            sum_logprob,
            no_speech_prob,
            temperature: 0.0,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn window_in(
        &self,
        seq: SeqId,
        prompt: &[u32],
        kv: SeqId,
        mel: &[f32],
        timestamps: bool,
        temperature: f32,
        rng: &mut Rng,
    ) -> Result<Decoded> {
        let s = self.specials;
        let (no_speech_prob, mut logits) = self.prompt_pass(seq, prompt, kv, mel)?;
        let limit = self.limit(prompt);
        let (mut tokens, mut sum_logprob) = (Vec::new(), 0f64);
        loop {
            self.filter(&mut logits, &tokens, timestamps);
            let logprobs = log_softmax(&logits);
            let next = if temperature == 0.0 {
                argmax(&logits)
            } else {
                sample(&logits, temperature, rng)
            };
            sum_logprob += f64::from(logprobs[next as usize]);
            if next == s.eot {
                break;
            }
            tokens.push(next);
            if tokens.len() >= limit {
                break;
            }
            logits = self.pass(seq, &[next], kv, &[], Rows::Last)?;
        }
        Ok(Decoded {
            tokens,
            sum_logprob,
            no_speech_prob,
            temperature,
        })
    }

    /// openai-whisper's logit filters in its order: no blank start, suppressed tokens, then the
    /// timestamp rules.
    fn filter(&self, logits: &mut [f32], sampled: &[u32], timestamps: bool) {
        let s = self.specials;
        let ninf = f32::NEG_INFINITY;
        if sampled.is_empty() {
            for &t in self.suppress_blank {
                logits[t as usize] = ninf;
            }
        }
        for &t in self.suppress {
            logits[t as usize] = ninf;
        }
        let tb = s.timestamp_begin as usize;
        if !timestamps {
            return;
        }
        logits[s.no_timestamps as usize] = ninf;
        let is_ts = |t: u32| t >= s.timestamp_begin;
        let last = sampled.last().is_some_and(|&t| is_ts(t));
        let penultimate = sampled.len() < 2 || is_ts(sampled[sampled.len() - 2]);
        if last {
            if penultimate {
                logits[tb..].fill(ninf);
            } else {
                logits[..s.eot as usize].fill(ninf);
            }
        }
        if let Some(&latest) = sampled.iter().rev().find(|&&t| is_ts(t)) {
            // Timestamps never go back; after a closing one, the next opens later.
            let floor = if last && !penultimate {
                latest
            } else {
                latest + 1
            };
            let end = (floor as usize).min(logits.len());
            logits[tb..end].fill(ninf);
        }
        if sampled.is_empty() {
            logits[..tb].fill(ninf);
            // The first timestamp is at most 1 s into the window.
            let last_allowed = tb + (1.0f64 / TIME_PRECISION).round() as usize;
            if last_allowed + 1 < logits.len() {
                logits[last_allowed + 1..].fill(ninf);
            }
        }
        // A timestamp wins when all timestamps together are likelier than any text token.
        let logprobs = log_softmax(logits);
        let timestamp_mass = log_sum_exp(&logprobs[tb..]);
        let best_text = logprobs[..tb]
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        if timestamp_mass > best_text {
            logits[..tb].fill(ninf);
        }
    }
}

/// Indices of the `k` largest values, largest first, ties to the lower index.
fn top_k(v: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..v.len() as u32).collect();
    let k = k.min(idx.len());
    idx.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| {
        v[b as usize].total_cmp(&v[a as usize]).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_by(|&a, &b| v[b as usize].total_cmp(&v[a as usize]).then(a.cmp(&b)));
    idx
}

/// The first index of the largest value.
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn sample(logits: &[f32], temperature: f32, rng: &mut Rng) -> u32 {
    let scaled: Vec<f32> = logits.iter().map(|&l| l / temperature).collect();
    let p = log_softmax(&scaled);
    let mut u = rng.uniform();
    for (i, &lp) in p.iter().enumerate() {
        u -= f64::from(lp).exp();
        if u < 0.0 {
            return i as u32;
        }
    }
    argmax(logits)
}

fn log_sum_exp(v: &[f32]) -> f32 {
    let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    let sum: f64 = v.iter().map(|&x| f64::from(x - max).exp()).sum();
    max + sum.ln() as f32
}

fn log_softmax(v: &[f32]) -> Vec<f32> {
    let lse = log_sum_exp(v);
    v.iter().map(|&x| x - lse).collect()
}

fn softmax_at(v: &[f32], i: usize) -> f64 {
    f64::from(log_softmax(v)[i]).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_of_equals() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }

    #[test]
    fn log_softmax_sums_to_one() {
        let p = log_softmax(&[1.0, 2.0, f32::NEG_INFINITY, 0.5]);
        let total: f64 = p.iter().map(|&x| f64::from(x).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(p[2], f32::NEG_INFINITY);
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let mut rng = Rng::new(7);
        let logits = [0.0f32, (3.0f32).ln()];
        let ones = (0..4000)
            .filter(|_| sample(&logits, 1.0, &mut rng) == 1)
            .count();
        assert!((2800..3200).contains(&ones), "{ones} of 4000");
    }
}
