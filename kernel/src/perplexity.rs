//! `u-runner perplexity`: a model's perplexity on a text, computed as llama.cpp's
//! `llama-perplexity` computes it, so both can be compared on the same file; and the KL
//! divergence against a base model's log-probabilities in llama.cpp's file format.
//!
//! - The text (one trailing newline dropped) is tokenized with BOS as the model adds it and
//!   special-token text read as plain text, and cut into chunks of `-c` tokens (the rest is
//!   dropped; at least two chunks' worth is needed).
//! - Each chunk is evaluated on a fresh sequence, its first token replaced by BOS when the
//!   model adds BOS. The first half is context; each position from `c/2` to `c − 2` scores the
//!   next token: `−log softmax(logits)[next]` (maximum in f32, the sum of exponentials and the
//!   logarithm in f64).
//! - PPL = exp(mean NLL) ± PPL·√((E[NLL²] − E[NLL]²)/(N − 1)), printed as it runs
//!   (`[k]ppl,`) and at the end (`Final estimate: PPL = … +/- …`).
//! - `--kl-divergence-base FILE` writes every scored row's log-probabilities (llama.cpp's
//!   `_logits_` file: a header, the tokens, then per row an f32 scale and minimum and one
//!   uint16 per vocabulary entry over the top 16 nats); with `--kl-divergence` the file is read
//!   instead, its tokens and chunks are evaluated, and KL(base ‖ model), the change in the
//!   correct token's probability and how often both pick the same top token are reported with
//!   llama.cpp's statistics.

use crate::{load_default, threads};
use abi_stable::std_types::{RSlice, RSliceMut};
use anyhow::{Context, Result, anyhow, bail};
use serde_json::json;
use std::{
    io::{Read, Write},
    path::PathBuf,
    time::Instant,
};
use u_runner::{progress, wiring};
use u_sdk::{KvCacheBox, ModelBox, Output, Rows, Segment, SeqChunk, TokenizerBox};

/// Options of `u-runner perplexity`.
#[derive(clap::Args)]
pub struct PerplexityArgs {
    /// The model file (or model directory).
    #[arg(long, short = 'm')]
    model: PathBuf,
    /// The text to evaluate (not needed with `--kl-divergence`, which takes the base file's
    /// tokens).
    #[arg(long, short = 'f', required_unless_present = "kl_divergence")]
    file: Option<PathBuf>,
    /// Tokens per chunk.
    #[arg(long = "ctx-size", short = 'c', default_value_t = 512)]
    ctx: u32,
    /// At most this many chunks [default: all].
    #[arg(long)]
    chunks: Option<u32>,
    /// llama.cpp's log-probability file: written by a plain run, read with `--kl-divergence`.
    #[arg(long)]
    kl_divergence_base: Option<PathBuf>,
    /// Compare with the base file's log-probabilities (KL divergence, Δp, same top token).
    #[arg(long, requires = "kl_divergence_base")]
    kl_divergence: bool,
    /// Compute threads [default: the deployment's, else all cores].
    #[arg(long, short = 't')]
    threads: Option<u32>,
    /// Print one JSON object at the end instead of llama.cpp's text.
    #[arg(long)]
    json: bool,
    /// The deployment [default: as for `generate`].
    #[arg(long)]
    deployment: Option<PathBuf>,
}

/// Largest logit block one forward pass returns (bytes), bounding memory for large vocabularies.
const ROWS_BYTES: usize = 256 << 20;

/// The file magic of llama.cpp's log-probability files.
const MAGIC: &[u8; 8] = b"_logits_";

/// `(max, ln Σ exp(l − max))`: the maximum in f32, the sum in f64 of f32 exponentials.
fn log_normalizer(row: &[f32]) -> (f32, f64) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| f64::from((l - max).exp())).sum();
    (max, sum.ln())
}

/// Sums of NLL and NLL², over `n` scored tokens.
#[derive(Default)]
struct Sums {
    nll: f64,
    nll2: f64,
    n: u64,
}

impl Sums {
    fn add(&mut self, nll: f64) {
        self.nll += nll;
        self.nll2 += nll * nll;
        self.n += 1;
    }
    fn ppl(&self) -> f64 {
        (self.nll / self.n as f64).exp()
    }
    /// The standard error of the perplexity (`None` when the variance is not positive).
    fn ppl_error(&self) -> Option<f64> {
        let n = self.n as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        (var > 0.0 && self.n > 1).then(|| self.ppl() * (var / (n - 1.0)).sqrt())
    }
}

/// A base file row: `logp[i] = scale · q[i] + min_log_prob`, and the rows' encoding.
mod row {
    /// Encodes `logits` as llama.cpp's row (`2 + 2 + n_vocab` uint16, even-padded) and returns
    /// the target's NLL computed as llama.cpp computes it there (in f32).
    pub fn encode(logits: &[f32], target: usize, out: &mut Vec<u8>) -> f64 {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let min = logits
            .iter()
            .copied()
            .fold(f32::INFINITY, f32::min)
            .max(max - 16.0);
        let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        let lse = sum.ln() as f32;
        let min_log_prob = min - max - lse;
        let scale = (max - min) / 65535.0;
        out.extend_from_slice(&scale.to_le_bytes());
        out.extend_from_slice(&min_log_prob.to_le_bytes());
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        for &l in logits {
            let q = if scale != 0.0 && l > min {
                (inv * (l - min)).round_ties_even() as u16
            } else {
                0
            };
            out.extend_from_slice(&q.to_le_bytes());
        }
        if logits.len() % 2 == 1 {
            out.extend_from_slice(&[0, 0]);
        }
        f64::from(max + lse - logits[target])
    }

    /// `nv`: uint16 slots per row.
    pub fn slots(n_vocab: usize) -> usize {
        2 * n_vocab.div_ceil(2) + 4
    }
}

/// The KL statistics, accumulated over scored tokens as llama.cpp accumulates them.
#[derive(Default)]
struct Kl {
    nll: f64,
    nll2: f64,
    nll_base: f64,
    nll_base2: f64,
    nll_nll_base: f64,
    kld: f64,
    kld2: f64,
    p_diff: f64,
    p_diff2: f64,
    p_diff4: f64,
    same_top: u64,
    n: u64,
    klds: Vec<f32>,
    p_diffs: Vec<f32>,
}

/// Mean and standard error (0 for ten samples or fewer).
fn mean_err(sum: f64, sum2: f64, n: u64) -> (f64, f64) {
    if n < 1 {
        return (0.0, 0.0);
    }
    let n = n as f64;
    let f = sum / n;
    let v = sum2 / n - f * f;
    (
        f,
        if v > 0.0 && n > 10.0 {
            (v / (n - 1.0)).sqrt()
        } else {
            0.0
        },
    )
}

fn covariance(a: f64, b: f64, ab: f64, n: u64) -> f64 {
    if n < 10 {
        return 0.0;
    }
    let n = n as f64;
    (ab / n - (a / n) * (b / n)) / (n - 1.0)
}

/// The `frac` quantile of sorted `v`, interpolated.
fn percentile(v: &[f32], frac: f32) -> f32 {
    if frac <= 0.0 {
        return v[0];
    }
    if frac >= 1.0 {
        return v[v.len() - 1];
    }
    let p = frac * (v.len() - 1) as f32;
    let i = p as usize;
    let p = p - i as f32;
    (1.0 - p) * v[i] + p * v[(i + 1).min(v.len() - 1)]
}

fn median(v: &[f32]) -> f32 {
    let n = v.len();
    if n.is_multiple_of(2) {
        0.5 * (v[n / 2] + v[n / 2 - 1])
    } else {
        v[n / 2]
    }
}

impl Kl {
    /// Adds one scored token: the model's logits, the base row (uint16 slots) and the target.
    fn add(&mut self, logits: &[f32], base: &[u16], target: usize) {
        let f32_at = |k: usize| f32::from_bits(u32::from(base[k]) | (u32::from(base[k + 1]) << 16));
        let (scale, min_log_prob) = (f32_at(0), f32_at(2));
        let q = &base[4..4 + logits.len()];
        let (mut max, mut imax) = (logits[0], 0);
        for (i, &l) in logits.iter().enumerate() {
            if l > max {
                (max, imax) = (l, i);
            }
        }
        let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        let lse = sum.ln() as f32;
        let nll = max + lse - logits[target];
        let nll_base = -(scale * f32::from(q[target]) + min_log_prob);
        self.nll += f64::from(nll);
        self.nll2 += f64::from(nll * nll);
        self.nll_base += f64::from(nll_base);
        self.nll_base2 += f64::from(nll_base * nll_base);
        self.nll_nll_base += f64::from(nll * nll_base);
        let m = max + lse;
        let mut kld = 0f64;
        let (mut base_max, mut imax_base) = (f32::NEG_INFINITY, 0);
        for (i, (&qi, &l)) in q.iter().zip(logits).enumerate() {
            let lb = scale * f32::from(qi) + min_log_prob;
            if i == 0 || lb > base_max {
                (base_max, imax_base) = (lb, i);
            }
            if lb > -16.0 {
                kld += f64::from(lb.exp() * (lb - l + m));
            }
        }
        self.kld += kld;
        self.kld2 += kld * kld;
        self.n += 1;
        if imax == imax_base {
            self.same_top += 1;
        }
        let dp = (-nll).exp() - (-nll_base).exp();
        let dp2 = f64::from(dp * dp);
        self.p_diff += f64::from(dp);
        self.p_diff2 += dp2;
        self.p_diff4 += dp2 * dp2;
        self.klds.push(kld as f32);
        self.p_diffs.push(dp);
    }

    /// One line of the running table (cumulative statistics).
    fn line(&self, chunk: usize) -> String {
        let (m, s) = mean_err(self.nll, self.nll2, self.n);
        let (mb, sb) = mean_err(self.nll_base, self.nll_base2, self.n);
        let cov = covariance(self.nll, self.nll_base, self.nll_nll_base, self.n);
        let (k, sk) = mean_err(self.kld, self.kld2, self.n);
        let (e, se) = mean_err(self.p_diff2, self.p_diff4, self.n);
        let r = e.sqrt();
        let pt = self.same_top as f64 / self.n as f64;
        format!(
            "{chunk:4}    {:9.4} ± {:9.4}    {:10.5} ± {:10.5}    {k:10.5} ± {sk:10.5}    {:6.3} ± {:6.3} %    {:6.3} ± {:6.3} %",
            m.exp(),
            m.exp() * s,
            m - mb,
            (s * s + sb * sb - 2.0 * cov).sqrt(),
            100.0 * r,
            100.0 * 0.5 / r * se,
            100.0 * pt,
            100.0 * (pt * (1.0 - pt) / (self.n as f64 - 1.0)).sqrt()
        )
    }

    /// The summary, as JSON.
    fn summary(&mut self) -> serde_json::Value {
        let (m, s) = mean_err(self.nll, self.nll2, self.n);
        let (mb, sb) = mean_err(self.nll_base, self.nll_base2, self.n);
        let cov = covariance(self.nll, self.nll_base, self.nll_nll_base, self.n);
        let (k, sk) = mean_err(self.kld, self.kld2, self.n);
        let (dp, sdp) = mean_err(self.p_diff, self.p_diff2, self.n);
        let (e, se) = mean_err(self.p_diff2, self.p_diff4, self.n);
        let pt = self.same_top as f64 / self.n as f64;
        self.klds.sort_by(f32::total_cmp);
        self.p_diffs.sort_by(f32::total_cmp);
        let (kv, pv) = (&self.klds, &self.p_diffs);
        json!({
            "tokens": self.n,
            "ppl": m.exp(), "ppl_error": m.exp() * s,
            "ppl_base": mb.exp(), "ppl_base_error": mb.exp() * sb,
            "cor_ln_ppl": if s * sb > 0.0 { cov / (s * sb) } else { 0.0 },
            "ln_ppl_ratio": m - mb, "ln_ppl_ratio_error": (s * s + sb * sb - 2.0 * cov).sqrt(),
            "kld_mean": k, "kld_error": sk,
            "kld_max": kv[kv.len() - 1], "kld_99_9": percentile(kv, 0.999),
            "kld_99": percentile(kv, 0.99), "kld_95": percentile(kv, 0.95),
            "kld_90": percentile(kv, 0.9), "kld_median": median(kv),
            "kld_10": percentile(kv, 0.1), "kld_5": percentile(kv, 0.05),
            "kld_1": percentile(kv, 0.01), "kld_0_1": percentile(kv, 0.001), "kld_min": kv[0],
            "dp_mean": dp, "dp_error": sdp,
            "dp_max": pv[pv.len() - 1], "dp_99_9": percentile(pv, 0.999),
            "dp_99": percentile(pv, 0.99), "dp_95": percentile(pv, 0.95),
            "dp_90": percentile(pv, 0.9), "dp_75": percentile(pv, 0.75), "dp_median": median(pv),
            "dp_25": percentile(pv, 0.25), "dp_10": percentile(pv, 0.1), "dp_5": percentile(pv, 0.05),
            "dp_1": percentile(pv, 0.01), "dp_0_1": percentile(pv, 0.001), "dp_min": pv[0],
            "dp_rms": e.sqrt(), "dp_rms_error": 0.5 / e.sqrt() * se,
            "same_top": pt, "same_top_error": (pt * (1.0 - pt) / (self.n as f64 - 1.0)).sqrt(),
        })
    }
}

/// Prints the KL summary in llama.cpp's layout.
fn print_kl_summary(s: &serde_json::Value) {
    let f = |k: &str| s[k].as_f64().unwrap_or(f64::NAN);
    let (p, pb) = (f("ppl"), f("ppl_base"));
    let (pu, pbu) = (f("ppl_error"), f("ppl_base_error"));
    let cov = f("cor_ln_ppl") * (pu / p) * (pbu / pb);
    println!("====== Perplexity statistics ======");
    println!("Mean PPL(Q)                   : {p:10.6} ± {pu:10.6}");
    println!("Mean PPL(base)                : {pb:10.6} ± {pbu:10.6}");
    println!(
        "Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2}%",
        100.0 * f("cor_ln_ppl")
    );
    println!(
        "Mean ln(PPL(Q)/PPL(base))     : {:10.6} ± {:10.6}",
        f("ln_ppl_ratio"),
        f("ln_ppl_ratio_error")
    );
    let r = f("ln_ppl_ratio").exp();
    println!(
        "Mean PPL(Q)/PPL(base)         : {r:10.6} ± {:10.6}",
        r * f("ln_ppl_ratio_error")
    );
    println!(
        "Mean PPL(Q)-PPL(base)         : {:10.6} ± {:10.6}",
        p - pb,
        (pu * pu + pbu * pbu - 2.0 * p * pb * cov).sqrt()
    );
    println!();
    println!("====== KL divergence statistics ======");
    println!(
        "Mean    KLD: {:10.6} ± {:10.6}",
        f("kld_mean"),
        f("kld_error")
    );
    for (label, k) in [
        ("Maximum", "kld_max"),
        ("99.9%  ", "kld_99_9"),
        ("99.0%  ", "kld_99"),
        ("95.0%  ", "kld_95"),
        ("90.0%  ", "kld_90"),
        ("Median ", "kld_median"),
        ("10.0%  ", "kld_10"),
        (" 5.0%  ", "kld_5"),
        (" 1.0%  ", "kld_1"),
        (" 0.1%  ", "kld_0_1"),
        ("Minimum", "kld_min"),
    ] {
        println!("{label} KLD: {:10.6}", f(k));
    }
    println!();
    println!("====== Token probability statistics ======");
    println!(
        "Mean    Δp: {:6.3} ± {:5.3} %",
        100.0 * f("dp_mean"),
        100.0 * f("dp_error")
    );
    for (label, k) in [
        ("Maximum", "dp_max"),
        ("99.9%  ", "dp_99_9"),
        ("99.0%  ", "dp_99"),
        ("95.0%  ", "dp_95"),
        ("90.0%  ", "dp_90"),
        ("75.0%  ", "dp_75"),
        ("Median ", "dp_median"),
        ("25.0%  ", "dp_25"),
        ("10.0%  ", "dp_10"),
        (" 5.0%  ", "dp_5"),
        (" 1.0%  ", "dp_1"),
        (" 0.1%  ", "dp_0_1"),
        ("Minimum", "dp_min"),
    ] {
        println!("{label} Δp: {:6.3}%", 100.0 * f(k));
    }
    println!(
        "RMS Δp    : {:6.3} ± {:5.3} %",
        100.0 * f("dp_rms"),
        100.0 * f("dp_rms_error")
    );
    println!(
        "Same top p: {:6.3} ± {:5.3} %",
        100.0 * f("same_top"),
        100.0 * f("same_top_error")
    );
}

/// Evaluates one chunk on a fresh sequence; calls `score(row_logits, next_token)` for each
/// scored position (`c/2` to `c − 2`).
fn eval_chunk(
    model: &ModelBox,
    cache: &KvCacheBox,
    vocab: usize,
    tokens: &[u32],
    mut score: impl FnMut(&[f32], u32),
) -> Result<()> {
    let first = tokens.len() / 2;
    let seq = cache
        .create()
        .into_result()
        .map_err(|e| anyhow!("cache.create: {e}"))?;
    let result = (|| -> Result<()> {
        let pass = |toks: &[u32], out: Output, logits: &mut [f32]| {
            let input = [Segment::Tokens(RSlice::from_slice(toks))];
            let chunk = [SeqChunk::tokens(seq, &input, out)];
            model
                .forward(
                    RSlice::from_slice(&chunk),
                    RSliceMut::from_mut_slice(logits),
                )
                .into_result()
                .map_err(|e| anyhow!("model.forward: {e}"))
        };
        for part in tokens[..first].chunks(512) {
            pass(part, Output::Nothing, &mut [])?;
        }
        let rows = (ROWS_BYTES / (vocab * 4)).clamp(1, 512);
        let mut logits = vec![0f32; rows * vocab];
        let scored = &tokens[first..tokens.len() - 1];
        for (k, part) in scored.chunks(rows).enumerate() {
            let out = &mut logits[..part.len() * vocab];
            pass(part, Output::Logits(Rows::All), out)?;
            for (j, row) in out.chunks_exact(vocab).enumerate() {
                let pos = first + k * rows + j;
                score(row, tokens[pos + 1]);
            }
        }
        Ok(())
    })();
    let _ = cache.release(seq);
    result
}

/// The model's tokens of `text`: BOS as the model adds it, special-token text as plain text.
fn tokenize(tok: &TokenizerBox, text: &str) -> Result<(Vec<u32>, Option<u32>)> {
    let specials = tok
        .special_tokens()
        .into_result()
        .map_err(|e| anyhow!("tokenizer: {e}"))?;
    let bos = specials
        .add_bos
        .then(|| specials.bos.into_option())
        .flatten();
    let empty = tok
        .encode("".into(), true, false)
        .into_result()
        .map_err(|e| anyhow!("tokenizer: {e}"))?;
    if empty.len() > usize::from(bos.is_some()) {
        bail!(
            "the model's tokenizer adds an end-of-sequence token: perplexity is not defined for it"
        );
    }
    let ids = tok
        .encode(text.into(), true, false)
        .into_result()
        .map_err(|e| anyhow!("tokenizer: {e}"))?;
    Ok((ids.into_vec(), bos))
}

fn read_i32(r: &mut impl Read, what: &str) -> Result<i32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)
        .with_context(|| format!("reading {what} from the base file"))?;
    Ok(i32::from_le_bytes(b))
}

/// Runs `u-runner perplexity`.
pub fn run(args: PerplexityArgs) -> Result<i32> {
    let d = load_default(args.deployment)?;
    let threads = args.threads.unwrap_or_else(|| threads(&d)).max(1);
    // The files are opened before the sandbox locks the process down to the model's paths.
    let text = match (&args.file, args.kl_divergence) {
        (Some(path), false) => Some(
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        ),
        _ => None,
    };
    let mut base_file = match &args.kl_divergence_base {
        Some(path) if args.kl_divergence => {
            Some(std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?)
        }
        Some(path) => Some(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        ),
        None => None,
    };
    let opened = wiring::open(&d, &args.model, threads, wiring::Want::Model)?;
    let model = opened.model.context("no model was built")?;
    let (_, config) = opened.built.context("no model was built")?;
    let tok = opened
        .tokenizer
        .context("the model has no tokenizer (no GGUF vocabulary, no tokenizer.json)")?;
    let cache = model
        .cache()
        .into_result()
        .map_err(|e| anyhow!("model.cache: {e}"))?
        .into_option()
        .context("the model keeps no KV cache: perplexity needs a decoder")?;
    let vocab = config.vocab_size as usize;

    // The tokens, chunk length and chunk count: from the text, or from the base file.
    let mut base = None;
    let (tokens, n_ctx, n_chunk, bos) = if args.kl_divergence {
        let path = args.kl_divergence_base.as_ref().expect("clap requires it");
        let mut f = std::io::BufReader::new(base_file.take().expect("opened above"));
        let mut magic = [0u8; 8];
        if f.read_exact(&mut magic).is_err() || &magic != MAGIC {
            bail!(
                "{} does not look like a file of log-probabilities",
                path.display()
            );
        }
        let n_ctx = read_i32(&mut f, "n_ctx")?;
        let n_vocab = read_i32(&mut f, "n_vocab")?;
        let n_chunk = read_i32(&mut f, "n_chunk")?;
        if n_ctx < 4 || n_chunk < 1 || n_vocab < 1 {
            bail!(
                "{}: bad header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk})",
                path.display()
            );
        }
        if n_vocab as usize != vocab {
            bail!(
                "{}: the base has {n_vocab} vocabulary entries, the model {vocab}",
                path.display()
            );
        }
        let total = (n_ctx as usize)
            .checked_mul(n_chunk as usize)
            .context("the base file's token count overflows")?;
        let mut tokens = Vec::with_capacity(total.min(1 << 24));
        for _ in 0..total {
            let t = read_i32(&mut f, "the evaluation tokens")?;
            if t < 0 || t as usize >= vocab {
                bail!("{}: token id {t} is out of range", path.display());
            }
            tokens.push(t as u32);
        }
        let (_, bos) = tokenize(&tok, "")?;
        base = Some(f);
        (tokens, n_ctx as usize, n_chunk as usize, bos)
    } else {
        let path = args.file.as_ref().expect("clap requires it");
        let mut text = text.expect("read above");
        if text.ends_with('\n') {
            text.pop();
        }
        let (tokens, bos) = tokenize(&tok, &text)?;
        let n_ctx = args.ctx as usize;
        if n_ctx < 4 {
            bail!("the context (-c) must be at least 4 tokens");
        }
        if tokens.len() < 2 * n_ctx {
            bail!(
                "you need at least {} tokens to evaluate perplexity with a context of {n_ctx}: \
                 {} tokenizes to only {} tokens",
                2 * n_ctx,
                path.display(),
                tokens.len()
            );
        }
        let max_chunks = tokens.len() / n_ctx;
        let n_chunk = args
            .chunks
            .map_or(max_chunks, |c| (c as usize).min(max_chunks));
        (tokens, n_ctx, n_chunk, bos)
    };
    if n_chunk == 0 {
        bail!("no chunk to evaluate (--chunks 0)");
    }

    // A plain run that names a base file writes it.
    let mut writer = match (&args.kl_divergence_base, args.kl_divergence) {
        (Some(_), false) => {
            let mut w = std::io::BufWriter::new(base_file.take().expect("created above"));
            w.write_all(MAGIC)?;
            for v in [n_ctx, vocab, n_chunk] {
                w.write_all(&(v as i32).to_le_bytes())?;
            }
            for &t in &tokens[..n_ctx * n_chunk] {
                w.write_all(&(t as i32).to_le_bytes())?;
            }
            Some(w)
        }
        _ => None,
    };

    if !args.json {
        eprintln!(
            "perplexity: {} chunks, n_ctx={n_ctx}, {} tokens scored per chunk, model {} ({})",
            n_chunk,
            n_ctx - 1 - n_ctx / 2,
            args.model.display(),
            config.family
        );
    }
    let progress = progress::Line::new(n_chunk as u64);
    let start = Instant::now();
    let mut sums = Sums::default();
    let mut kl = Kl::default();
    let mut running = Vec::with_capacity(n_chunk);
    let mut row_bytes = Vec::new();
    let slots = row::slots(vocab);
    let mut base_row = vec![0u16; slots];
    let mut raw = vec![0u8; 2 * slots];
    if args.kl_divergence && !args.json {
        println!();
        println!(
            "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p"
        );
    }
    for c in 0..n_chunk {
        let mut input = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if let Some(b) = bos {
            input[0] = b;
        }
        let mut failed = None;
        eval_chunk(&model, &cache, vocab, &input, |logits, next| {
            if failed.is_some() {
                return;
            }
            let t = next as usize;
            if let Some(w) = writer.as_mut() {
                row_bytes.clear();
                sums.add(row::encode(logits, t, &mut row_bytes));
                if let Err(e) = w.write_all(&row_bytes) {
                    failed = Some(anyhow!("writing the base file: {e}"));
                }
            } else if let Some(f) = base.as_mut() {
                if let Err(e) = f.read_exact(&mut raw) {
                    failed = Some(anyhow!(
                        "reading the base file's log-probabilities for chunk {}: {e}",
                        c + 1
                    ));
                    return;
                }
                for (d, b) in base_row.iter_mut().zip(raw.chunks_exact(2)) {
                    *d = u16::from_le_bytes([b[0], b[1]]);
                }
                kl.add(logits, &base_row, t);
            } else {
                let (max, lse) = log_normalizer(logits);
                sums.add(lse - f64::from(logits[t] - max));
            }
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        if args.kl_divergence {
            if !args.json {
                println!("{}", kl.line(c + 1));
            }
            progress.update(
                (c + 1) as u64,
                &format!(
                    "{}/{n_chunk} chunks, PPL {:.4}",
                    c + 1,
                    (kl.nll / kl.n as f64).exp()
                ),
            );
        } else {
            let ppl = sums.ppl();
            running.push(ppl);
            if !args.json {
                print!("[{}]{ppl:.4},", c + 1);
                let _ = std::io::stdout().flush();
            }
            progress.update(
                (c + 1) as u64,
                &format!("{}/{n_chunk} chunks, PPL {ppl:.4}", c + 1),
            );
        }
    }
    progress.finish();
    if let Some(mut w) = writer {
        w.flush().context("writing the base file")?;
    }
    let secs = start.elapsed().as_secs_f64();
    if args.kl_divergence {
        if kl.n < 100 {
            bail!(
                "only {} tokens were scored: the KL statistics need at least 100",
                kl.n
            );
        }
        let summary = kl.summary();
        if args.json {
            println!(
                "{}",
                json!({ "chunks": n_chunk, "n_ctx": n_ctx, "seconds": secs, "kl": summary })
            );
        } else {
            println!();
            print_kl_summary(&summary);
        }
        return Ok(0);
    }
    let ppl = sums.ppl();
    let err = sums.ppl_error();
    if args.json {
        println!(
            "{}",
            json!({
                "ppl": ppl, "ppl_error": err, "chunks": n_chunk, "n_ctx": n_ctx,
                "tokens_scored": sums.n, "running": running, "seconds": secs,
            })
        );
    } else {
        println!();
        match err {
            Some(e) => eprintln!("Final estimate: PPL = {ppl:.4} +/- {e:.5}"),
            None => eprintln!("Final estimate: PPL = {ppl:.4} (no variance to estimate an error)"),
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_encode_as_llama_cpp_lays_them_out() {
        let logits = [2.0f32, 0.5, -30.0];
        let mut out = Vec::new();
        let nll = row::encode(&logits, 1, &mut out);
        assert_eq!(out.len(), 2 * row::slots(3));
        let f = |k: usize| f32::from_le_bytes(out[k..k + 4].try_into().unwrap());
        let (scale, min_log_prob) = (f(0), f(4));
        let q = |i: usize| u16::from_le_bytes([out[8 + 2 * i], out[9 + 2 * i]]);
        // The maximum is q = 65535, anything 16 below the maximum is 0 (= min_log_prob).
        assert_eq!((q(0), q(2)), (65535, 0));
        let (max, lse) = log_normalizer(&logits);
        let logp = |i: usize| scale * f32::from(q(i)) + min_log_prob;
        assert!((f64::from(logp(0)) - (f64::from(2.0 - max) - lse)).abs() < 1e-5);
        assert!((f64::from(logp(1)) - (f64::from(0.5 - max) - lse)).abs() < 1e-3);
        assert!((nll - (lse - f64::from(0.5 - max))).abs() < 1e-5);
    }

    #[test]
    fn identical_logits_have_no_divergence() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let mut bytes = Vec::new();
        row::encode(&logits, 7, &mut bytes);
        let base: Vec<u16> = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let mut kl = Kl::default();
        kl.add(&logits, &base, 7);
        assert!(kl.kld.abs() < 1e-4, "{}", kl.kld);
        assert_eq!(kl.same_top, 1);
        assert!((kl.nll - kl.nll_base).abs() < 1e-3);
        // A shifted distribution diverges.
        let other: Vec<f32> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| l + (i % 3) as f32)
            .collect();
        let mut kl2 = Kl::default();
        kl2.add(&other, &base, 7);
        assert!(kl2.kld > 0.05, "{}", kl2.kld);
    }

    #[test]
    fn quantiles_interpolate() {
        let v = [0.0f32, 1.0, 2.0, 3.0];
        assert_eq!(percentile(&v, 0.5), 1.5);
        assert_eq!(percentile(&v, 0.0), 0.0);
        assert_eq!(percentile(&v, 1.0), 3.0);
        assert_eq!(median(&v), 1.5);
        assert_eq!(median(&v[..3]), 1.0);
    }
}
