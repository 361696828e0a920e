//! `u-runner train`: fine-tunes what changes a model's behaviour without touching its weights,
//! writing files the rest of U (and PEFT, and llama.cpp) loads.
//!
//! - `train lora` and `train soft-prompt`: the model's trainer ([`u_sdk::Model::trainer`])
//!   learns a LoRA or a soft prompt on a text. The text is tokenized once (BOS as the model
//!   adds it) and cut into windows of `--seq-len` tokens; each step accumulates the gradients of
//!   `--batch` windows (in a shuffled order fixed by `--seed`, reshuffled each epoch) and takes
//!   one AdamW step at the scheduled learning rate (linear warm-up, then linear or cosine decay,
//!   or constant). A progress line shows the loss, tokens/s and the time left. Every
//!   `--checkpoint-every` steps, and on SIGINT/SIGTERM, the trainer's state (parameters and
//!   optimizer moments) goes to `OUT/checkpoint/`; `--resume` continues from there, taking the
//!   same steps an uninterrupted run would. The result is PEFT's adapter directory:
//!   `adapter_model.safetensors` and `adapter_config.json`.
//! - `train control-vector`: repeng's and llama.cpp's `cvector-generator` method. For each
//!   pair of a positive and a negative prompt (line by line), the hidden state after every
//!   block at the last token; per block, the direction is the mean of the differences
//!   (`--method mean`) or their first principal component (`pca`, unit length, signed so that
//!   positives project above negatives). Written as llama.cpp's control-vector GGUF
//!   (`general.architecture = controlvector`, `direction.{L}` for blocks `1..L`).
//!
//! The files are read, and the output directory made, before the sandbox locks the process
//! down; the lock-down leaves the host able to write beneath the output only.

use crate::{load_default, threads};
use abi_stable::std_types::{RSlice, RSliceMut, RVec};
use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};
use std::{
    io::IsTerminal,
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::Instant,
};
use u_attest::deployment::{PathGrant, absolute};
use u_runner::{progress, wiring};
use u_sdk::{
    ModelBox, NamedValues, Output, Rows, Segment, SeqChunk, TokenizerBox, TrainSpec, TrainTarget,
    TrainerBox,
};

/// Options of `u-runner train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Fine-tune a LoRA (PEFT format) on a text.
    Lora(LoraArgs),
    /// Learn a soft prompt (PEFT prompt tuning) on a text.
    SoftPrompt(SoftPromptArgs),
    /// Derive a control vector from pairs of contrasting prompts.
    ControlVector(ControlVectorArgs),
}

/// Options every trainer run takes.
#[derive(clap::Args)]
struct Run {
    /// The model file (or model directory).
    #[arg(long, short = 'm')]
    model: PathBuf,
    /// The training text.
    #[arg(long, short = 'f')]
    data: PathBuf,
    /// The output directory (the adapter, and `checkpoint/` while training).
    #[arg(long, short = 'o')]
    out: PathBuf,
    /// Tokens per training window.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Windows per optimizer step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Passes over the text.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Optimizer steps [default: as many as the epochs take].
    #[arg(long)]
    steps: Option<usize>,
    /// Peak learning rate [default: 2e-4 for a LoRA, 3e-2 for a soft prompt].
    #[arg(long)]
    lr: Option<f32>,
    /// Steps of linear warm-up.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// The learning rate after warm-up.
    #[arg(long, value_enum, default_value_t = Schedule::Linear)]
    schedule: Schedule,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f32,
    /// Largest global gradient norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    clip: f32,
    /// Write a checkpoint every this many steps (0: only on interrupt).
    #[arg(long, default_value_t = 50)]
    checkpoint_every: usize,
    /// Continue from `OUT/checkpoint/`.
    #[arg(long)]
    resume: bool,
    /// Seed of the initial values and of the data order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Windows the loss on the text is measured over before and after training (the first
    /// ones; 0: no measurement).
    #[arg(long, default_value_t = 16)]
    eval_windows: usize,
    /// Print a plain line every this many steps (0: none).
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    #[command(flatten)]
    host: Host,
}

/// How every `train` command runs.
#[derive(clap::Args)]
struct Host {
    /// Compute threads [default: the deployment's, else all cores].
    #[arg(long, short = 't')]
    threads: Option<u32>,
    /// Print a JSON summary at the end.
    #[arg(long)]
    json: bool,
    /// The deployment [default: as for `generate`].
    #[arg(long)]
    deployment: Option<PathBuf>,
}

/// How the learning rate falls after warm-up.
#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
enum Schedule {
    /// Linearly to 0 at the last step (Hugging Face's default).
    Linear,
    /// Along a half cosine to 0.
    Cosine,
    /// Kept at its peak.
    Constant,
}

#[derive(clap::Args)]
struct LoraArgs {
    #[command(flatten)]
    run: Run,
    /// The rank of each `A`/`B` pair.
    #[arg(long, default_value_t = 8)]
    rank: u32,
    /// LoRA's alpha (the delta is scaled by alpha / rank).
    #[arg(long, default_value_t = 16.0)]
    alpha: f32,
    /// Rank-stabilised scaling (alpha / √rank).
    #[arg(long)]
    rslora: bool,
    /// The projections adapted, PEFT's module names separated by commas.
    #[arg(long, default_value = "q_proj,v_proj", value_delimiter = ',')]
    targets: Vec<String>,
}

#[derive(clap::Args)]
struct SoftPromptArgs {
    #[command(flatten)]
    run: Run,
    /// Rows of the soft prompt.
    #[arg(long, default_value_t = 20)]
    virtual_tokens: u32,
    /// Start from the embeddings of this text's tokens (repeated to length) [default: random
    /// vocabulary rows].
    #[arg(long)]
    init_text: Option<String>,
}

#[derive(clap::Args)]
struct ControlVectorArgs {
    /// The model file (or model directory).
    #[arg(long, short = 'm')]
    model: PathBuf,
    /// Prompts of the behaviour wanted, one per line.
    #[arg(long)]
    positive: PathBuf,
    /// Prompts of its opposite, one per line, paired with the positive ones.
    #[arg(long)]
    negative: PathBuf,
    /// The control vector file written (GGUF).
    #[arg(long, short = 'o')]
    out: PathBuf,
    /// How a block's direction is taken from the differences.
    #[arg(long, value_enum, default_value_t = Method::Pca)]
    method: Method,
    #[command(flatten)]
    host: Host,
}

/// How a control vector's direction is taken from the positive − negative differences.
#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
enum Method {
    /// Their first principal component (unit length).
    Pca,
    /// Their mean.
    Mean,
}

/// Set by SIGINT/SIGTERM: the loop writes a checkpoint and stops.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Runs `u-runner train`.
pub fn run(args: TrainArgs) -> Result<i32> {
    match args.what {
        What::Lora(a) => {
            let target = TrainTarget::Lora {
                rank: a.rank,
                alpha: a.alpha,
                rslora: a.rslora,
                targets: a.targets.iter().map(|t| t.trim().into()).collect(),
            };
            fit(a.run, target, None, 2e-4)
        }
        What::SoftPrompt(a) => {
            let target = TrainTarget::SoftPrompt {
                virtual_tokens: a.virtual_tokens,
                init: RVec::new(),
            };
            fit(a.run, target, a.init_text, 3e-2)
        }
        What::ControlVector(a) => control_vector(a),
    }
}

/// The learning rate of step `t` of `total`.
fn learning_rate(peak: f32, t: usize, total: usize, warmup: usize, schedule: Schedule) -> f32 {
    if t < warmup {
        return peak * (t + 1) as f32 / warmup as f32;
    }
    let span = total.saturating_sub(warmup).max(1) as f32;
    let done = (t - warmup) as f32 / span;
    match schedule {
        Schedule::Constant => peak,
        Schedule::Linear => peak * (1.0 - done),
        Schedule::Cosine => peak * 0.5 * (1.0 + (std::f32::consts::PI * done).cos()),
    }
}

/// The window order of `epoch`: a Fisher–Yates shuffle seeded by `seed` and the epoch.
fn order(windows: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut state = seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5555;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut v: Vec<usize> = (0..windows).collect();
    for i in (1..windows).rev() {
        v.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    v
}

/// The tokens of `text` (BOS as the model adds it, special-token text as plain text).
fn tokenize(tok: &TokenizerBox, text: &str, add_special: bool) -> Result<Vec<u32>> {
    Ok(tok
        .encode(text.into(), add_special, false)
        .into_result()
        .map_err(|e| anyhow!("tokenizer: {e}"))?
        .into_vec())
}

/// Makes `out` (before lock-down) and returns its grant.
fn output_grant(out: &Path) -> Result<PathGrant> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    Ok(PathGrant {
        path: absolute(out),
        recursive: true,
    })
}

/// What a checkpoint must agree with to be resumed.
fn run_identity(spec: &TrainSpec, data: &[u32], r: &Run) -> Value {
    // FNV-1a over the tokens: stable across builds, unlike std's hasher.
    let hash = data
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    json!({
        "spec": format!("{spec:?}"),
        "data_tokens": data.len(),
        "data_hash": format!("{hash:016x}"),
        "seq_len": r.seq_len,
        "batch": r.batch,
        "seed": r.seed,
    })
}

/// Trains a LoRA or soft prompt (see the module documentation).
fn fit(r: Run, target: TrainTarget, init_text: Option<String>, default_lr: f32) -> Result<i32> {
    if r.seq_len < 2 || r.batch == 0 || r.epochs == 0 {
        bail!("--seq-len must be at least 2, --batch and --epochs at least 1");
    }
    let d = load_default(r.host.deployment.clone())?;
    let threads = r.host.threads.unwrap_or_else(|| threads(&d)).max(1);
    let text = std::fs::read_to_string(&r.data)
        .with_context(|| format!("reading {}", r.data.display()))?;
    let grant = output_grant(&r.out)?;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let opened = wiring::open_writing(&d, &r.model, threads, wiring::Want::Model, vec![grant])?;
    let model = opened.model.context("no model was built")?;
    let tok = opened
        .tokenizer
        .context("the model has no tokenizer (no GGUF vocabulary, no tokenizer.json)")?;
    let data = tokenize(&tok, &text, true)?;
    let windows: Vec<&[u32]> = data.chunks(r.seq_len).filter(|w| w.len() >= 2).collect();
    if windows.is_empty() {
        bail!("{} holds fewer than two tokens", r.data.display());
    }
    let target = match (target, init_text) {
        (TrainTarget::SoftPrompt { virtual_tokens, .. }, Some(t)) => TrainTarget::SoftPrompt {
            virtual_tokens,
            init: tokenize(&tok, &t, false)?.into(),
        },
        (t, _) => t,
    };
    let spec = TrainSpec {
        target,
        seed: r.seed,
        weight_decay: r.weight_decay,
        clip: r.clip,
    };
    let mut trainer = model
        .trainer(spec.clone())
        .into_result()
        .map_err(|e| anyhow!("model.trainer: {e}"))?;
    let per_epoch = windows.len().div_ceil(r.batch);
    let total = r.steps.unwrap_or(per_epoch * r.epochs).max(1);
    let identity = run_identity(&spec, &data, &r);
    let checkpoint = r.out.join("checkpoint");
    let mut step = 0;
    if r.resume {
        step = resume(&mut trainer, &checkpoint, &identity)?;
        eprintln!("u-runner train: resumed at step {step} of {total}");
    }
    let evaluated = &windows[..r.eval_windows.min(windows.len())];
    let before = mean_loss(&trainer, evaluated)?;
    let lr = r.lr.unwrap_or(default_lr);
    let resumed_at = step;
    let line = progress::Line::new(total.saturating_sub(step) as u64);
    let started = Instant::now();
    let terminal = std::io::stderr().is_terminal();
    let (mut tokens, mut first_loss, mut last_loss) = (0u64, None, f32::NAN);
    let mut interrupted = false;
    // The shuffled window order of the epoch being read, made once per epoch.
    let mut shuffled: Option<(usize, Vec<usize>)> = None;
    while step < total {
        let mut loss = 0f32;
        let mut shown = 0;
        for j in 0..r.batch {
            let i = step * r.batch + j;
            let epoch = i / windows.len();
            if shuffled.as_ref().is_none_or(|(e, _)| *e != epoch) {
                shuffled = Some((epoch, order(windows.len(), r.seed, epoch)));
            }
            let w = windows[shuffled.as_ref().expect("made above").1[i % windows.len()]];
            loss += trainer
                .accumulate(RSlice::from_slice(w))
                .into_result()
                .map_err(|e| anyhow!("step {step}: {e}"))?;
            tokens += w.len() as u64;
            shown += 1;
        }
        let rate = learning_rate(lr, step, total, r.warmup, r.schedule);
        let norm = trainer
            .step(rate)
            .into_result()
            .map_err(|e| anyhow!("step {step}: {e}"))?;
        last_loss = loss / shown as f32;
        first_loss.get_or_insert(last_loss);
        step += 1;
        let secs = started.elapsed().as_secs_f64();
        let tps = tokens as f64 / secs.max(1e-9);
        line.update(
            (step - resumed_at) as u64,
            &format!("step {step}/{total} loss {last_loss:.4} {tps:.0} tok/s"),
        );
        if r.log_every > 0 && (step % r.log_every == 0 || step == total) {
            // On a terminal, the line clears the progress line it replaces.
            let clear = if terminal { "\r\x1b[2K" } else { "" };
            eprintln!(
                "{clear}step {step}/{total} loss {last_loss:.4} lr {rate:.3e} grad-norm {norm:.3} {tps:.0} tok/s"
            );
        }
        interrupted = INTERRUPTED.load(Ordering::SeqCst);
        if interrupted || (r.checkpoint_every > 0 && step % r.checkpoint_every == 0) {
            save_checkpoint(&trainer, &checkpoint, &identity, step)?;
        }
        if interrupted {
            break;
        }
    }
    line.finish();
    if interrupted {
        eprintln!(
            "u-runner train: interrupted at step {step} of {total}; the checkpoint is in {} \
             (continue with --resume)",
            checkpoint.display()
        );
        return Ok(130);
    }
    let trained = trainer
        .export()
        .into_result()
        .map_err(|e| anyhow!("trainer.export: {e}"))?;
    let mut config: Value = serde_json::from_str(&trained.config)?;
    config["base_model_name_or_path"] = json!(absolute(&r.model).display().to_string());
    write_safetensors(&r.out.join("adapter_model.safetensors"), &trained.tensors)?;
    write_atomic(
        &r.out.join("adapter_config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    let secs = started.elapsed().as_secs_f64();
    let after = mean_loss(&trainer, evaluated)?;
    let summary = json!({
        "steps": total,
        "windows": windows.len(),
        "loss_before": before,
        "loss_after": after,
        "tokens": tokens,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "seconds": secs,
        "tokens_per_second": tokens as f64 / secs.max(1e-9),
        "out": r.out.display().to_string(),
    });
    if r.host.json {
        println!("{summary}");
    } else {
        let show = |l: Option<f32>| l.map_or("-".to_string(), |l| format!("{l:.4}"));
        eprintln!(
            "u-runner train: {total} steps; loss on the text {} → {}; wrote {}",
            show(before),
            show(after),
            r.out.display()
        );
    }
    Ok(0)
}

/// The mean loss over `windows` (`None` for none).
fn mean_loss(trainer: &TrainerBox, windows: &[&[u32]]) -> Result<Option<f32>> {
    if windows.is_empty() {
        return Ok(None);
    }
    let mut sum = 0f64;
    for w in windows {
        let l = trainer
            .loss(RSlice::from_slice(w))
            .into_result()
            .map_err(|e| anyhow!("trainer.loss: {e}"))?;
        sum += f64::from(l);
    }
    Ok(Some((sum / windows.len() as f64) as f32))
}

/// Writes the trainer's state and where the run stands, replacing the last checkpoint whole.
fn save_checkpoint(trainer: &TrainerBox, dir: &Path, identity: &Value, step: usize) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let state = trainer
        .state()
        .into_result()
        .map_err(|e| anyhow!("trainer.state: {e}"))?;
    write_safetensors(&dir.join("state.safetensors"), &state)?;
    let mut progress = identity.clone();
    progress["step"] = json!(step);
    write_atomic(&dir.join("progress.json"), progress.to_string().as_bytes())
}

/// Restores the checkpoint in `dir`; the step it was taken at.
fn resume(trainer: &mut TrainerBox, dir: &Path, identity: &Value) -> Result<usize> {
    let path = dir.join("progress.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("--resume: reading {}", path.display()))?;
    let mut progress: Value = serde_json::from_str(&text)
        .with_context(|| format!("--resume: {} is not JSON", path.display()))?;
    let step = progress["step"]
        .as_u64()
        .with_context(|| format!("--resume: {} gives no step", path.display()))?;
    progress
        .as_object_mut()
        .map(|o| o.remove("step"))
        .context("--resume: the progress file is not an object")?;
    if &progress != identity {
        bail!(
            "--resume: the checkpoint in {} was taken for other data or settings ({progress} \
             here, {identity} now)",
            dir.display()
        );
    }
    let state = read_safetensors(&dir.join("state.safetensors"))?;
    trainer
        .restore(state.into())
        .into_result()
        .map_err(|e| anyhow!("--resume: {e}"))?;
    Ok(step as usize)
}

/// Writes `bytes` to a temporary file beside `path` and renames it over `path`.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// Writes `tensors` as a safetensors file (see [`u_train::state`]).
fn write_safetensors(path: &Path, tensors: &[NamedValues]) -> Result<()> {
    let bytes = u_train::state::encode(tensors).map_err(|e| anyhow!("{e}"))?;
    write_atomic(path, &bytes)
}

/// The tensors of a safetensors file [`write_safetensors`] wrote.
fn read_safetensors(path: &Path) -> Result<Vec<NamedValues>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    u_train::state::decode(&bytes).map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// The hidden state after each of blocks `1..layers` at the last token of `tokens`.
fn last_hidden(model: &ModelBox, tokens: &[u32], layers: u32, hidden: usize) -> Result<Vec<f32>> {
    let cache = model
        .cache()
        .into_result()
        .map_err(|e| anyhow!("model.cache: {e}"))?
        .into_option()
        .context("the model keeps no KV cache: control vectors need a decoder")?;
    let mut seqs = Vec::new();
    let result = (|| -> Result<Vec<f32>> {
        for _ in 1..layers {
            seqs.push(
                cache
                    .create()
                    .into_result()
                    .map_err(|e| anyhow!("cache.create: {e}"))?,
            );
        }
        let input = [Segment::Tokens(RSlice::from_slice(tokens))];
        let chunks: Vec<SeqChunk<'_>> = seqs
            .iter()
            .zip(1..layers)
            .map(|(&seq, layer)| {
                let out = Output::Hidden {
                    layer,
                    rows: Rows::Last,
                };
                SeqChunk::tokens(seq, &input, out)
            })
            .collect();
        let mut out = vec![0f32; chunks.len() * hidden];
        model
            .forward(
                RSlice::from_slice(&chunks),
                RSliceMut::from_mut_slice(&mut out),
            )
            .into_result()
            .map_err(|e| anyhow!("model.forward: {e}"))?;
        Ok(out)
    })();
    for s in seqs {
        let _ = cache.release(s);
    }
    result
}

/// The first principal direction of the rows of `d` (uncentred, as llama.cpp's generator
/// takes it): power iteration on `dᵀd`, unit length.
fn principal(d: &[Vec<f64>], hidden: usize) -> Vec<f64> {
    let mut v: Vec<f64> = (0..hidden).map(|i| 1.0 + (i % 7) as f64 * 0.01).collect();
    for _ in 0..200 {
        let mut next = vec![0f64; hidden];
        for row in d {
            let p: f64 = row.iter().zip(&v).map(|(a, b)| a * b).sum();
            next.iter_mut().zip(row).for_each(|(n, r)| *n += p * r);
        }
        let norm = next.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm == 0.0 {
            return next;
        }
        next.iter_mut().for_each(|x| *x /= norm);
        v = next;
    }
    v
}

/// Reads the non-empty lines of `path`.
fn lines(path: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect())
}

/// `train control-vector` (see the module documentation).
fn control_vector(a: ControlVectorArgs) -> Result<i32> {
    let d = load_default(a.host.deployment.clone())?;
    let threads = a.host.threads.unwrap_or_else(|| threads(&d)).max(1);
    let (pos, neg) = (lines(&a.positive)?, lines(&a.negative)?);
    if pos.is_empty() || pos.len() != neg.len() {
        bail!(
            "{} positive and {} negative prompts: they are paired line by line, at least one pair",
            pos.len(),
            neg.len()
        );
    }
    let parent = absolute(&a.out)
        .parent()
        .map(Path::to_path_buf)
        .context("the output has no directory")?;
    let grant = output_grant(&parent)?;
    let opened = wiring::open_writing(&d, &a.model, threads, wiring::Want::Model, vec![grant])?;
    let model = opened.model.context("no model was built")?;
    let (_, config) = opened.built.context("no model was built")?;
    let tok = opened
        .tokenizer
        .context("the model has no tokenizer (no GGUF vocabulary, no tokenizer.json)")?;
    let (layers, hidden) = (config.layers, config.hidden as usize);
    if layers < 2 {
        bail!("a control vector needs a model of at least two blocks");
    }
    let started = Instant::now();
    let line = progress::Line::new(pos.len() as u64);
    // Per block, the differences of the pairs.
    let mut diffs: Vec<Vec<Vec<f64>>> = vec![Vec::new(); layers as usize - 1];
    for (n, (p, q)) in pos.iter().zip(&neg).enumerate() {
        let hp = last_hidden(&model, &tokenize(&tok, p, true)?, layers, hidden)?;
        let hq = last_hidden(&model, &tokenize(&tok, q, true)?, layers, hidden)?;
        for (l, (a, b)) in hp
            .chunks_exact(hidden)
            .zip(hq.chunks_exact(hidden))
            .enumerate()
        {
            diffs[l].push(a.iter().zip(b).map(|(x, y)| f64::from(x - y)).collect());
        }
        line.update(n as u64 + 1, &format!("pair {}/{}", n + 1, pos.len()));
    }
    line.finish();
    let mut directions = Vec::new();
    for (l, d) in diffs.iter().enumerate() {
        let mean: Vec<f64> = (0..hidden)
            .map(|i| d.iter().map(|r| r[i]).sum::<f64>() / d.len() as f64)
            .collect();
        let v = match a.method {
            Method::Mean => mean,
            Method::Pca => {
                let v = principal(d, hidden);
                let along: f64 = v.iter().zip(&mean).map(|(a, b)| a * b).sum();
                let sign = if along < 0.0 { -1.0 } else { 1.0 };
                v.into_iter().map(|x| x * sign).collect()
            }
        };
        directions.push((
            l as u32 + 1,
            v.into_iter().map(|x| x as f32).collect::<Vec<_>>(),
        ));
    }
    write_control_vector(&a.out, &config.family, &directions)?;
    let summary = json!({
        "pairs": pos.len(),
        "layers": directions.len(),
        "method": format!("{:?}", a.method).to_lowercase(),
        "seconds": started.elapsed().as_secs_f64(),
        "out": a.out.display().to_string(),
    });
    if a.host.json {
        println!("{summary}");
    } else {
        eprintln!(
            "u-runner train: a control vector of {} blocks from {} pairs; wrote {}",
            directions.len(),
            pos.len(),
            a.out.display()
        );
    }
    Ok(0)
}

/// llama.cpp's control-vector GGUF: `direction.{L}` `F32` `[hidden]` per block.
fn write_control_vector(path: &Path, family: &str, directions: &[(u32, Vec<f32>)]) -> Result<()> {
    use crate::quantize::gguf;
    use u_sdk::{DType, MetaValue};
    let metadata = vec![
        (
            "general.architecture".to_string(),
            MetaValue::Str("controlvector".into()),
        ),
        (
            "controlvector.model_hint".to_string(),
            MetaValue::Str(family.into()),
        ),
        (
            "controlvector.layer_count".to_string(),
            MetaValue::UInt(directions.len() as u64),
        ),
    ];
    let entries: Vec<gguf::TensorEntry> = directions
        .iter()
        .map(|(l, v)| gguf::TensorEntry {
            name: format!("direction.{l}"),
            dims: vec![v.len() as u64],
            dtype: DType::F32,
            bytes: 4 * v.len() as u64,
        })
        .collect();
    let (header, _) = gguf::header(&metadata, &entries).map_err(|why| anyhow!("{why}"))?;
    let mut file = header;
    for (_, v) in directions {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        gguf::write_padded(&mut file, &bytes)?;
    }
    write_atomic(path, &file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_warms_up_then_falls() {
        let lr = |t, s| learning_rate(1.0, t, 10, 2, s);
        assert_eq!(
            (lr(0, Schedule::Linear), lr(1, Schedule::Linear)),
            (0.5, 1.0)
        );
        assert_eq!(lr(2, Schedule::Linear), 1.0);
        assert!((lr(6, Schedule::Linear) - 0.5).abs() < 1e-6);
        assert!((lr(6, Schedule::Cosine) - 0.5).abs() < 1e-6);
        assert_eq!(lr(9, Schedule::Constant), 1.0);
    }

    #[test]
    fn the_data_order_is_a_permutation_fixed_by_seed_and_epoch() {
        let a = order(10, 3, 0);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(a, order(10, 3, 0));
        assert_ne!(a, order(10, 3, 1));
    }

    #[test]
    fn the_principal_direction_of_aligned_differences_is_theirs() {
        let d = vec![
            vec![2.0, 0.0, 0.1],
            vec![3.0, 0.1, 0.0],
            vec![-2.5, 0.0, 0.0],
        ];
        let v = principal(&d, 3);
        assert!(v[0].abs() > 0.99, "{v:?}");
    }
}
