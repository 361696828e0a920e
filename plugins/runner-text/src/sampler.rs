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
        draw_weighted(&candidates, r)
    }

    /// Picks the next token where a draft proposed `draft` (speculative sampling, Leviathan et
    /// al. 2023 and Chen et al. 2023, with a draft that is certain of its token): greedy, the
    /// most likely token; otherwise `draft` with probability `p(draft)`, else a draw from `p`
    /// without it, renormalised. Either way the token is distributed exactly as
    /// [`Sampler::sample`] draws it; only the random stream differs.
    pub fn verify(&mut self, logits: &mut [f32], history: &[u32], draft: u32) -> u32 {
        apply_penalties(logits, history, &self.params);
        if self.is_greedy() || logits.len() <= 1 {
            return argmax(logits);
        }
        let mut candidates = self.candidates(logits);
        let kept = candidates
            .iter()
            .find(|c| c.0 == draft)
            .map_or(0.0, |c| c.1);
        if self.rng.next_f64() < kept {
            return draft;
        }
        candidates.retain(|c| c.0 != draft);
        let rest: f64 = candidates.iter().map(|c| c.1).sum();
        if rest <= 0.0 {
            return draft;
        }
        candidates.iter_mut().for_each(|c| c.1 /= rest);
        let r = self.rng.next_f64();
        draw_weighted(&candidates, r)
    }

    /// The tokens left after temperature, top-k, top-p and min-p, each with its renormalised
    /// probability, most likely first.
    pub fn candidates(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let p = &self.params;
        let w = Weights::new(logits, 1.0 / f64::from(p.temperature));
        let top_k = (p.top_k > 0).then_some(p.top_k as usize);
        let top_p = (p.top_p > 0.0 && p.top_p < 1.0).then(|| f64::from(p.top_p));
        // Rank only as far as the filters can reach: the k best, the mass top-p needs (with a
        // margin for rounding; the cut below is exact), or every token min-p could keep.
        let ranked = w.ranked(|count, mass, floor| match (top_k, top_p) {
            (Some(k), _) => count < k,
            (None, Some(top_p)) => mass < (top_p + 1e-6) * w.total,
            (None, None) => floor > f64::from(p.min_p),
        });
        let mut c: Vec<(u32, f64)> = match top_k {
            Some(k) => ranked.into_iter().take(k).collect(),
            None => ranked,
        };
        // Softmax over what is kept: the k best after top-k, else the whole vocabulary.
        let norm = if top_k.is_some() {
            c.iter().map(|x| x.1).sum()
        } else {
            w.total
        };
        if norm > 0.0 && norm.is_finite() {
            for x in &mut c {
                x.1 /= norm;
            }
        } else {
            // All logits −∞: uniform rather than a division by zero.
            let n = c.len() as f64;
            for x in &mut c {
                x.1 = 1.0 / n;
            }
        }
        if let Some(target) = top_p {
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

/// [`draw`] over every token of `softmax(logits · inv_t)`, most likely first, ranking only as
/// far as the draw reaches (a full sort of the vocabulary for every token of every request
/// was the server's hot spot). The same distribution and order as [`Sampler::candidates`].
fn draw_all(logits: &[f32], inv_t: f64, r: f64) -> u32 {
    let w = Weights::new(logits, inv_t);
    if !(w.total > 0.0 && w.total.is_finite()) {
        // All logits −∞ (or none): uniform over the tokens in id order, as `candidates`.
        let valid: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| !logits[i as usize].is_nan())
            .collect();
        return valid
            .get((r * valid.len() as f64) as usize)
            .map_or(0, |&i| i);
    }
    let target = r * w.total;
    let ranked = w.ranked(|_, mass, _| mass <= target);
    draw_weighted(&ranked, target)
}

/// Inverse-CDF draw over weights (most likely first) at `target` in `[0, Σ weights)`: with
/// probabilities, `target` is a uniform draw in `[0, 1)`.
fn draw_weighted(ranked: &[(u32, f64)], target: f64) -> u32 {
    let mut acc = 0.0;
    for &(id, q) in ranked {
        acc += q;
        if target < acc {
            return id;
        }
    }
    least_likely(ranked)
}

/// One row's softmax weights `exp((logit − max) · inv_t)`, relative to the most likely token
/// (whose weight is 1), and their sum; 0 for NaN logits.
struct Weights<'a> {
    logits: &'a [f32],
    w: Vec<f32>,
    total: f64,
}

impl<'a> Weights<'a> {
    fn new(logits: &'a [f32], inv_t: f64) -> Self {
        // NaN never compares greater, so it never becomes the maximum.
        let max = logits
            .iter()
            .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
        let inv_t = inv_t as f32;
        let w: Vec<f32> = if max == f32::INFINITY {
            // ∞ − ∞ is NaN: the +∞ logits share the mass.
            logits.iter().map(|&l| f32::from(l == max)).collect()
        } else {
            logits
                .iter()
                .map(|&l| exp_nonpositive((l - max) * inv_t))
                .collect()
        };
        // Eight partial sums: vectorisable, and the same order on every machine.
        let mut lanes = [0f64; 8];
        let chunks = w.chunks_exact(8);
        let tail: f64 = chunks.remainder().iter().map(|&x| f64::from(x)).sum();
        for chunk in chunks {
            for (lane, &x) in lanes.iter_mut().zip(chunk) {
                *lane += f64::from(x);
            }
        }
        let total = lanes.iter().sum::<f64>() + tail;
        Self { logits, w, total }
    }

    /// Tokens with their weights, most likely first (equal logits in id order), ranked band by
    /// band of weight — `[1/16, ∞)`, then 256 times lower each time, then the rest — while
    /// `more(count, mass, floor)` says the ranking so far (its length, its weight, the band's
    /// lower edge) is not enough. Each band costs one pass over the row and a sort of only
    /// the tokens in it.
    fn ranked(&self, mut more: impl FnMut(usize, f64, f64) -> bool) -> Vec<(u32, f64)> {
        let order = |a: &u32, b: &u32| {
            self.logits[*b as usize]
                .total_cmp(&self.logits[*a as usize])
                .then(a.cmp(b))
        };
        let mut out: Vec<(u32, f64)> = Vec::new();
        let (mut mass, mut hi, mut lo) = (0.0, f32::INFINITY, 1.0 / 16.0);
        let mut band = Vec::new();
        loop {
            band.clear();
            band.extend(
                (0..self.w.len() as u32).filter(|&i| (lo..hi).contains(&self.w[i as usize])),
            );
            band.sort_unstable_by(order);
            for &i in &band {
                let q = f64::from(self.w[i as usize]);
                mass += q;
                out.push((i, q));
            }
            if lo == 0.0 || !more(out.len(), mass, f64::from(lo)) {
                return out;
            }
            hi = lo;
            lo = if lo > 1e-30 { lo / 256.0 } else { 0.0 };
        }
    }
}

/// `e^x` for `x ≤ 0` to within a few units in the last place, in plain arithmetic the compiler
/// vectorises (and that gives the same bits on every platform, unlike the C library's `exp`);
/// 0 for `x ≤ −87` and for NaN.
fn exp_nonpositive(x: f32) -> f32 {
    // Adding 1.5 · 2^23 rounds a float of magnitude below 2^22 to an integer n, which the
    // sum's low mantissa bits then hold (offset by 2^22).
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = if x > -87.0 { x } else { -87.0 };
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Taylor series to r^7 on |r| ≤ ln 2 / 2: truncation below 1e-8.
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    // 2^n: n + 127 into the exponent field.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(0x4b40_0000).wrapping_add(127) << 23);
    if x > -87.0 { p * scale } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Speculative verification draws tokens as sampling does: 40 000 draws of each, on
    /// logits with a filter, agree to 0.01 per token, whether the draft is likely or not.
    #[test]
    fn verifying_a_draft_samples_the_same_distribution() {
        let logits = [2.0f32, 1.5, 0.2, -1.0, 0.9, -3.0];
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            seed: abi_stable::std_types::ROption::RSome(9),
            ..greedy()
        };
        let n = 40_000;
        let freq = |draw: &mut dyn FnMut() -> u32| {
            let mut f = vec![0f64; logits.len()];
            for _ in 0..n {
                f[draw() as usize] += 1.0 / n as f64;
            }
            f
        };
        let mut s = Sampler::new(&params);
        let want = freq(&mut || s.sample(&mut logits.clone(), &[]));
        for draft in [0u32, 3, 5] {
            let mut v = Sampler::new(&params);
            let got = freq(&mut || v.verify(&mut logits.clone(), &[], draft));
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 0.01, "draft {draft}: {got:?} vs {want:?}");
            }
        }
        let mut g = Sampler::new(&greedy());
        assert_eq!(
            g.verify(&mut logits.clone(), &[], 3),
            0,
            "greedy ignores the draft"
        );
    }
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

    /// The reference: a full f64 softmax of `logits · inv_t`, sorted most likely first.
    fn sorted_softmax(logits: &[f32], inv_t: f64) -> Vec<(u32, f64)> {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        let mut c: Vec<(u32, f64)> = (0..logits.len() as u32)
            .map(|i| {
                (
                    i,
                    ((f64::from(logits[i as usize]) - f64::from(max)) * inv_t).exp(),
                )
            })
            .collect();
        let sum: f64 = c.iter().map(|x| x.1).sum();
        c.iter_mut().for_each(|x| x.1 /= sum);
        c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        c
    }

    /// The banded draw and the filtered candidates pick what a full f64 sort of the softmax
    /// picks, for every `r` on a fine grid (but within rounding of a boundary), on a
    /// vocabulary large enough to need many bands.
    #[test]
    fn banded_draws_equal_the_fully_sorted_draw() {
        let mut rng = Rng::seeded(11);
        let logits: Vec<f32> = (0..5000)
            .map(|i| {
                if i % 97 == 0 {
                    3.0
                } else {
                    (rng.next_f64() * 40.0 - 30.0) as f32
                }
            })
            .collect();
        for t in [0.3f32, 1.0, 2.5] {
            let reference = sorted_softmax(&logits, 1.0 / f64::from(t));
            let s = Sampler::new(&params(|p| p.temperature = t));
            let full = s.candidates(&logits);
            assert_eq!(full.len(), logits.len());
            let boundaries: Vec<f64> = reference
                .iter()
                .scan(0.0, |acc, x| {
                    *acc += x.1;
                    Some(*acc)
                })
                .collect();
            for i in 0..20_000 {
                let r = (f64::from(i) + 0.5) / 20_000.0;
                let want = draw_weighted(&reference, r);
                for got in [
                    draw_weighted(&full, r),
                    draw_all(&logits, 1.0 / f64::from(t), r),
                ] {
                    // f32 weights move a boundary by at most a few parts in 10^7.
                    let near_boundary = boundaries.iter().any(|b| (b - r).abs() < 1e-6);
                    assert!(
                        got == want || near_boundary,
                        "temperature {t}, r {r}: drew {got}, want {want}"
                    );
                }
            }
        }
    }

    /// Top-p and min-p over a large vocabulary keep what the full sort keeps.
    #[test]
    fn banded_filters_keep_what_the_full_sort_keeps() {
        let mut rng = Rng::seeded(5);
        let logits: Vec<f32> = (0..20_000)
            .map(|_| (rng.next_f64() * 12.0 - 6.0) as f32)
            .collect();
        let reference = sorted_softmax(&logits, 1.0);
        let ids = |c: &[(u32, f64)]| c.iter().map(|x| x.0).collect::<Vec<_>>();
        for top_p in [0.1f32, 0.5, 0.9, 0.99] {
            let mut mass = 0.0;
            let keep = reference
                .iter()
                .take_while(|x| {
                    let below = mass < f64::from(top_p) - 1e-9;
                    mass += x.1;
                    below
                })
                .count();
            let got = Sampler::new(&params(|p| p.top_p = top_p)).candidates(&logits);
            assert_eq!(ids(&got), ids(&reference[..keep]), "top_p {top_p}");
        }
        for min_p in [0.001f32, 0.05, 0.5] {
            let floor = reference[0].1 * f64::from(min_p);
            let want: Vec<u32> = reference
                .iter()
                .filter(|x| x.1 >= floor)
                .map(|x| x.0)
                .collect();
            let got = Sampler::new(&params(|p| p.min_p = min_p)).candidates(&logits);
            assert_eq!(ids(&got), want, "min_p {min_p}");
        }
    }

    /// The softmax weights' exponential against f64's, over its whole range.
    #[test]
    fn the_weight_exponential_is_accurate_to_a_few_ulp() {
        for i in 0..200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let want = f64::from(x).exp();
            let got = f64::from(exp_nonpositive(x));
            assert!(
                ((got - want) / want).abs() < 4e-7,
                "exp({x}) = {got}, want {want}"
            );
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-87.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(f32::NAN), 0.0);
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
