//! Log-probabilities of generated tokens: a log-softmax of the model's raw logits (before
//! penalties, temperature and the other sampling filters), as OpenAI's `logprobs` reports them.

/// Most alternatives a request may ask for per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// One row of logits, ready to report log-probabilities from.
pub(crate) struct LogSoftmax {
    /// `log Σ exp(logit)`, computed in f64 around the maximum.
    lse: f64,
    /// The `n` most likely ids with their log-probabilities, best first (ties: lower id first).
    top: Vec<(u32, f32)>,
}

impl LogSoftmax {
    /// The normaliser of `logits` and its `n` most likely tokens.
    pub(crate) fn new(logits: &[f32], n: usize) -> Self {
        let max = logits
            .iter()
            .copied()
            .filter(|l| !l.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits
            .iter()
            .filter(|l| !l.is_nan())
            .map(|&l| (f64::from(l) - f64::from(max)).exp())
            .sum();
        let lse = f64::from(max) + sum.ln();
        let mut ids: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| !logits[i as usize].is_nan())
            .collect();
        let better = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let n = n.min(ids.len());
        if n > 0 && n < ids.len() {
            ids.select_nth_unstable_by(n - 1, better);
        }
        ids.truncate(n);
        ids.sort_unstable_by(better);
        let top = ids
            .into_iter()
            .map(|i| (i, (f64::from(logits[i as usize]) - lse) as f32))
            .collect();
        Self { lse, top }
    }

    /// The log-probability of a token whose raw logit is `logit`.
    pub(crate) fn of(&self, logit: f32) -> f32 {
        (f64::from(logit) - self.lse) as f32
    }

    /// The most likely tokens, best first.
    pub(crate) fn top(&self) -> &[(u32, f32)] {
        &self.top
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_the_definition() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NAN, -1.0];
        let ls = LogSoftmax::new(&logits, 3);
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0, -1.0].iter().map(|l| l.exp()).sum();
        let want = |l: f64| (l - z.ln()) as f32;
        assert_eq!(
            ls.top().iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 3, 2]
        );
        for &(id, lp) in ls.top() {
            assert!((lp - want(f64::from(logits[id as usize]))).abs() < 1e-6);
        }
        assert!((ls.of(-1.0) - want(-1.0)).abs() < 1e-6);
        assert!(LogSoftmax::new(&logits, 0).top().is_empty());
        assert_eq!(LogSoftmax::new(&logits, 99).top().len(), 5);
    }
}
