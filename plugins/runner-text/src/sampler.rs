//! Turning one row of logits into one token id.
//!
//! The chain, in order (the order `transformers` applies its logits processors):
//! 1. penalties over the tokens seen so far (prompt and generated): repetition (CTRL: a positive
//!    logit is divided by the penalty, a negative one multiplied), presence (`-= presence` once
//!    a token occurred) and frequency (`-= frequency × count`);
//! 2. greedy when `temperature <= 0`: the largest logit, the first one on ties (as `argmax`);
//! 3. otherwise logits divided by the temperature, then top-k, softmax, top-p (the smallest
//!    set of most likely tokens whose mass reaches `top_p`), min-p (tokens below
//!    `min_p × p_max` dropped), and one draw from what is left, renormalised.
//!
//! Draws come from [`Rng`], a xoshiro256** generator seeded through SplitMix64: the same seed
//! gives the same tokens on every platform and every build.

use std::collections::HashMap;
use u_sdk::SamplingParams;

/// Sampling settings that change nothing: greedy decoding.
pub fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: abi_stable::std_types::ROption::RNone,
    }
}

/// A small, fast, reproducible pseudo-random generator (xoshiro256**).
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose whole stream is fixed by `seed`.
    pub fn seeded(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            // SplitMix64, to spread any seed (even 0) over the full state.
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    /// A generator seeded from the clock and the process (not reproducible).
    pub fn from_entropy() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let local = 0u8;
        Self::seeded(t ^ (std::process::id() as u64).rotate_left(32) ^ (&local as *const u8 as u64))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform float in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Samples tokens for one request with its [`SamplingParams`].
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// A sampler for `params`, seeded from `params.seed` (or from entropy when unset).
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            abi_stable::std_types::ROption::RSome(seed) => Rng::seeded(seed),
            abi_stable::std_types::ROption::RNone => Rng::from_entropy(),
        };
        Self {
            params: params.clone(),
            rng,
        }
    }

    /// Whether this sampler always picks the most likely token.
    pub fn is_greedy(&self) -> bool {
        // NaN counts as greedy too.
        self.params.temperature.is_nan() || self.params.temperature <= 0.0
    }

    /// Picks the next token from `logits` (modified in place by the penalties), given the
    /// tokens seen so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        apply_penalties(logits, history, &self.params);
        if self.is_greedy() || logits.len() <= 1 {
            return argmax(logits);
        }
        let p = &self.params;
        if p.top_k == 0 && !(p.top_p > 0.0 && p.top_p < 1.0) && p.min_p <= 0.0 {
            let r = self.rng.next_f64();
            return draw_all(logits, 1.0 / f64::from(p.temperature), r);
        }
        let candidates = self.candidates(logits);
        let r = self.rng.next_f64();
        draw(&candidates, r)
    }

    /// The tokens left after temperature, top-k, top-p and min-p, each with its renormalised
    /// probability, most likely first.
    pub fn candidates(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let p = &self.params;
        let mut c = scaled(logits, 1.0 / f64::from(p.temperature));
        // Most likely first; equal logits keep id order so results are deterministic.
        let order = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && (p.top_k as usize) < c.len() {
            // Partition first so only the k kept tokens are sorted.
            let k = p.top_k as usize;
            c.select_nth_unstable_by(k - 1, order);
            c.truncate(k);
        }
        c.sort_by(order);
        softmax_in_place(&mut c);
        if p.top_p < 1.0 && p.top_p > 0.0 {
            let target = f64::from(p.top_p);
            let mut mass = 0.0;
            let mut keep = c.len();
            for (i, (_, q)) in c.iter().enumerate() {
                mass += q;
                // A tiny tolerance so a mass that reaches `top_p` up to rounding counts.
                if mass >= target - 1e-9 {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let floor = c.first().map_or(0.0, |x| x.1) * f64::from(p.min_p);
            c.retain(|x| x.1 >= floor);
        }
        let total: f64 = c.iter().map(|x| x.1).sum();
        if total > 0.0 {
            for x in &mut c {
                x.1 /= total;
            }
        }
        c
    }
}

/// Applies repetition, presence and frequency penalties for the tokens in `history`.
pub fn apply_penalties(logits: &mut [f32], history: &[u32], p: &SamplingParams) {
    let repetition = p.repetition_penalty != 1.0 && p.repetition_penalty > 0.0;
    if !repetition && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 {
        return;
    }
    let mut counts: HashMap<u32, u32> = HashMap::new();
    for &t in history {
        *counts.entry(t).or_default() += 1;
    }
    for (&t, &n) in &counts {
        let Some(l) = logits.get_mut(t as usize) else {
            continue;
        };
        if repetition {
            *l = if *l > 0.0 {
                *l / p.repetition_penalty
            } else {
                *l * p.repetition_penalty
            };
        }
        *l -= p.presence_penalty + p.frequency_penalty * n as f32;
    }
}

/// Index of the largest value, the first on ties (NaN never wins).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in row.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

fn softmax_in_place(c: &mut [(u32, f64)]) {
    let Some(max) = c.first().map(|x| x.1) else {
        return;
    };
    let mut sum = 0.0;
    for x in c.iter_mut() {
        let v = (x.1 - max).exp();
        x.1 = if v.is_nan() { 0.0 } else { v };
        sum += x.1;
    }
    let n = c.len() as f64;
    for x in c.iter_mut() {
        // All logits −∞: fall back to uniform rather than dividing by zero.
        x.1 = if sum > 0.0 { x.1 / sum } else { 1.0 / n };
    }
}

/// Inverse-CDF draw with `r` in `[0, 1)` over probabilities summing to 1.
fn draw(candidates: &[(u32, f64)], r: f64) -> u32 {
    let mut acc = 0.0;
    for &(id, q) in candidates {
        acc += q;
        if r < acc {
            return id;
        }
    }
    least_likely(candidates)
}

/// What a draw returns when rounding left `r` past the total of `candidates` (most likely
/// first): the least likely token with any probability.
fn least_likely(candidates: &[(u32, f64)]) -> u32 {
    candidates
        .iter()
        .rev()
        .find(|x| x.1 > 0.0)
        .or(candidates.last())
        .map_or(0, |x| x.0)
}

/// Every token but NaN logits, with its logit times `inv_t` (1 / temperature), in id order.
fn scaled(logits: &[f32], inv_t: f64) -> Vec<(u32, f64)> {
    logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, f64::from(l) * inv_t))
        .collect()
}

/// [`draw`] over every token of `softmax(logits · inv_t)`, most likely first, sorting only as
/// far as the draw reaches: the next most likely tokens are partitioned off in growing chunks
/// and sorted chunk by chunk (a full sort of the vocabulary for every token of every request
/// was the server's hot spot). The same distribution and order as [`Sampler::candidates`]; the
/// normalising sum is taken in token order.
fn draw_all(logits: &[f32], inv_t: f64, r: f64) -> u32 {
    let mut c = scaled(logits, inv_t);
    let max = c.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    for x in &mut c {
        let v = (x.1 - max).exp();
        x.1 = if v.is_nan() { 0.0 } else { v };
        sum += x.1;
    }
    if c.is_empty() || sum.is_nan() || sum <= 0.0 {
        // All logits −∞ (or none): uniform over the tokens in id order, as `softmax_in_place`.
        return c.get((r * c.len() as f64) as usize).map_or(0, |x| x.0);
    }
    let order = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let target = r * sum;
    let mut acc = 0.0;
    let (mut start, mut chunk) = (0, 64);
    while start < c.len() {
        let rest = &mut c[start..];
        let k = chunk.min(rest.len());
        if k < rest.len() {
            rest.select_nth_unstable_by(k - 1, order);
        }
        rest[..k].sort_unstable_by(order);
        for &(id, e) in &rest[..k] {
            acc += e;
            if target < acc {
                return id;
            }
        }
        start += k;
        chunk *= 4;
    }
    least_likely(&c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use abi_stable::std_types::ROption;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = greedy();
        p.temperature = 1.0;
        p.seed = ROption::RSome(42);
        f(&mut p);
        p
    }

    fn ln(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    /// Frequencies of each id over `n` draws.
    fn histogram(p: &SamplingParams, logits: &[f32], n: usize) -> Vec<f64> {
        let mut s = Sampler::new(p);
        let mut h = vec![0.0; logits.len()];
        for _ in 0..n {
            let mut row = logits.to_vec();
            h[s.sample(&mut row, &[]) as usize] += 1.0;
        }
        h.iter().map(|c| c / n as f64).collect()
    }

    fn assert_close(got: &[f64], want: &[f64], tol: f64) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol,
                "id {i}: frequency {g:.4}, expected {w:.4} (±{tol}); all {got:?}"
            );
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(&greedy());
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 3.0], &[]), 1);
        assert_eq!(s.sample(&mut [f32::NAN, -5.0, -4.0], &[]), 2);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let logits = ln(&[0.2; 5]);
        let run = |seed| {
            let mut s = Sampler::new(&params(|p| p.seed = ROption::RSome(seed)));
            (0..64)
                .map(|_| s.sample(&mut logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    /// The partial-sort draw picks what the fully sorted candidate list picks, for every `r`
    /// on a fine grid, on a vocabulary large enough to need several chunks.
    #[test]
    fn the_partial_sort_draw_equals_the_full_candidate_draw() {
        let mut rng = Rng::seeded(11);
        let logits: Vec<f32> = (0..5000)
            .map(|i| {
                if i % 97 == 0 {
                    3.0
                } else {
                    (rng.next_f64() * 8.0 - 4.0) as f32
                }
            })
            .collect();
        for t in [0.3f32, 1.0, 2.5] {
            let s = Sampler::new(&params(|p| p.temperature = t));
            let full = s.candidates(&logits);
            let mut differ = 0;
            for i in 0..20_000 {
                let r = (f64::from(i) + 0.5) / 20_000.0;
                if draw(&full, r) != draw_all(&logits, 1.0 / f64::from(t), r) {
                    differ += 1;
                }
            }
            // Only a draw within rounding of a boundary may differ (none on this grid).
            assert_eq!(differ, 0, "temperature {t}");
        }
    }

    #[test]
    fn draws_follow_the_softmax_distribution() {
        let probs = [0.5, 0.3, 0.15, 0.05];
        let h = histogram(&params(|_| {}), &ln(&probs), 40_000);
        assert_close(&h, &probs, 0.01);
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        let probs = [0.6, 0.3, 0.1];
        let logits = ln(&probs);
        for t in [0.5f64, 2.0] {
            let want: Vec<f64> = {
                let w: Vec<f64> = probs.iter().map(|p| p.powf(1.0 / t)).collect();
                let s: f64 = w.iter().sum();
                w.iter().map(|x| x / s).collect()
            };
            let h = histogram(&params(|p| p.temperature = t as f32), &logits, 40_000);
            assert_close(&h, &want, 0.01);
        }
    }

    #[test]
    fn top_k_keeps_k_tokens_renormalised() {
        let probs = [0.1, 0.4, 0.2, 0.3];
        let h = histogram(&params(|p| p.top_k = 2), &ln(&probs), 30_000);
        assert_close(&h, &[0.0, 4.0 / 7.0, 0.0, 3.0 / 7.0], 0.012);
        assert_eq!(h[0] + h[2], 0.0);
    }

    #[test]
    fn top_p_cuts_at_exactly_the_mass() {
        let logits = ln(&[0.125, 0.5, 0.125, 0.25]);
        let ids = |top_p: f32| -> Vec<u32> {
            let s = Sampler::new(&params(|p| p.top_p = top_p));
            s.candidates(&logits).iter().map(|c| c.0).collect()
        };
        assert_eq!(ids(0.5), vec![1]);
        assert_eq!(ids(0.75), vec![1, 3]);
        assert_eq!(ids(0.76), vec![1, 3, 0]);
        assert_eq!(ids(1.0), vec![1, 3, 0, 2]);
        // Renormalised over what is kept.
        let s = Sampler::new(&params(|p| p.top_p = 0.75));
        let c = s.candidates(&logits);
        assert!((c[0].1 - 2.0 / 3.0).abs() < 1e-6 && (c[1].1 - 1.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn min_p_drops_tokens_below_the_scaled_top_probability() {
        let logits = ln(&[0.5, 0.3, 0.15, 0.05]);
        let s = Sampler::new(&params(|p| p.min_p = 0.25));
        let ids: Vec<u32> = s.candidates(&logits).iter().map(|c| c.0).collect();
        assert_eq!(ids, vec![0, 1, 2]); // 0.05 < 0.25 × 0.5 ≤ 0.15
        let h = histogram(&params(|p| p.min_p = 0.5), &logits, 20_000);
        assert_close(&h, &[0.625, 0.375, 0.0, 0.0], 0.012);
    }

    #[test]
    fn penalties_change_exactly_the_seen_tokens() {
        let base = vec![2.0f32, -2.0, 1.0, 0.5];
        let history = [0, 1, 0, 3, 0];
        let mut l = base.clone();
        apply_penalties(&mut l, &history, &params(|p| p.repetition_penalty = 2.0));
        assert_eq!(l, vec![1.0, -4.0, 1.0, 0.25]);
        let mut l = base.clone();
        apply_penalties(&mut l, &history, &params(|p| p.presence_penalty = 0.5));
        assert_eq!(l, vec![1.5, -2.5, 1.0, 0.0]);
        let mut l = base.clone();
        apply_penalties(&mut l, &history, &params(|p| p.frequency_penalty = 0.25));
        assert_eq!(l, vec![1.25, -2.25, 1.0, 0.25]);
        // Ids past the vocabulary are ignored, not a panic.
        let mut l = base.clone();
        apply_penalties(&mut l, &[99], &params(|p| p.repetition_penalty = 2.0));
        assert_eq!(l, base);
    }

    #[test]
    fn a_repetition_penalty_turns_greedy_away_from_a_repeated_token() {
        let mut s = Sampler::new(&params(|p| {
            p.temperature = 0.0;
            p.repetition_penalty = 1.5;
        }));
        assert_eq!(s.sample(&mut [3.0, 2.5, 0.0], &[0]), 1);
        assert_eq!(s.sample(&mut [3.0, 2.5, 0.0], &[2]), 0);
    }
}
