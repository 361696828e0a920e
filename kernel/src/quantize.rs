//! `u-runner quantize IN OUT TYPE`: a GGUF model re-written with its weights quantized, as
//! llama.cpp 0.3.36's `llama-quantize IN OUT TYPE` writes it without an importance matrix.
//!
//! - The input is opened through the deployment's loader plugins (the output file is created
//!   before the sandbox locks the process down to the input's paths). An HF checkpoint (a
//!   safetensors folder) is read through its architecture plugin's GGUF view
//!   (`Architecture::gguf_view`: llama.cpp's names, row order and hyper-parameter keys) and its
//!   `tokenizer.json` through the tokenizer plugin's `gguf_metadata`, so the file is what
//!   llama.cpp's converter followed by `llama-quantize` would write.
//! - Each tensor's type is chosen as llama-quantize chooses it ([`policy`]: 1-D tensors and
//!   norms keep theirs, `output.weight` gets Q6_K, the Q4_K_M/Q5_K_M mixes, fallbacks for rows
//!   that are not whole blocks); the types Q4_K and Q5_K stand for llama-quantize's Q4_K_M and
//!   Q5_K_M files.
//! - Each tensor whose type changes is converted by the kernels plugin's backend (`Copy` into
//!   the new dtype, whose block formats are ggml's reference quantizers byte for byte), in
//!   slabs of rows; others are copied as stored. Quantized inputs are refused unless
//!   `--allow-requantize` is given, as llama-quantize refuses them.
//! - Every metadata key is copied in order, then `general.quantization_version` (2) and
//!   `general.file_type` are set last, as llama-quantize sets them; split keys are dropped.
//!   Integers are typed `uint32`/`int32` and floats `float32` (what llama.cpp's converter
//!   writes), since the loader interface carries values, not GGUF's stored widths.
//! - The file is GGUF v3 with 32-byte alignment, tensors in llama.cpp's order (by layer, then
//!   by name), their dimensions counted as ggml counts them (outer dimensions of 1 dropped).

pub(crate) mod gguf;
mod policy;

use crate::{load_default, threads};
use abi_stable::std_types::RSliceMut;
use anyhow::{Context, Result, anyhow, bail};
use std::{
    fs::File,
    io::{BufWriter, Write},
    path::PathBuf,
};
use u_runner::{progress, wiring};
use u_sdk::{DType, MetaValue, TokenizerBox, WeightSetBox, nn::Device};

/// Options of `u-runner quantize`.
#[derive(clap::Args)]
pub struct QuantizeArgs {
    /// The model to quantize: GGUF with F32, F16 or BF16 weights, or an HF checkpoint folder
    /// (safetensors, `config.json`, `tokenizer.json`).
    input: PathBuf,
    /// The GGUF file to write.
    output: PathBuf,
    /// The file type: F16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K (llama-quantize's Q4_K_M), Q5_K
    /// (Q5_K_M), Q6_K, TQ1_0 or TQ2_0.
    #[arg(value_name = "TYPE")]
    file_type: String,
    /// Quantize tensors that are already quantized (dequantized first), as llama-quantize's
    /// `--allow-requantize`.
    #[arg(long)]
    allow_requantize: bool,
    /// Compute threads [default: the deployment's, else all cores].
    #[arg(long, short = 't')]
    threads: Option<u32>,
    /// The deployment [default: as for `generate`].
    #[arg(long)]
    deployment: Option<PathBuf>,
}

/// Values converted per backend call: bounds the memory a slab takes.
const SLAB_VALUES: usize = 1 << 22;

/// Metadata keys llama-quantize does not copy (or sets itself).
const DROPPED: [&str; 5] = [
    "general.quantization_version",
    "general.file_type",
    "split.no",
    "split.count",
    "split.tensors.count",
];

/// One tensor to write: where it comes from and what it becomes.
struct Planned {
    name: String,
    dims: Vec<u64>,
    stored: DType,
    target: DType,
    bytes: u64,
}

/// Runs `u-runner quantize`.
pub fn run(args: QuantizeArgs) -> Result<i32> {
    let file = policy::file_type(&args.file_type).ok_or_else(|| {
        let names: Vec<&str> = policy::FILE_TYPES
            .iter()
            .flat_map(|(_, n)| n.iter().copied())
            .collect();
        anyhow!(
            "unknown TYPE `{}` (one of {})",
            args.file_type,
            names.join(", ")
        )
    })?;
    let d = load_default(args.deployment.clone())?;
    let threads = args.threads.unwrap_or_else(|| threads(&d)).max(1);
    if !args.input.exists() {
        bail!("the model {} does not exist", args.input.display());
    }
    let same = std::fs::canonicalize(&args.input).ok() == std::fs::canonicalize(&args.output).ok();
    if same {
        bail!(
            "the output would overwrite the input {}",
            args.input.display()
        );
    }
    // The output is created before the sandbox locks the process down to the input's paths.
    let out = File::create(&args.output)
        .with_context(|| format!("creating {}", args.output.display()))?;
    let opened = wiring::open(&d, &args.input, threads, wiring::Want::Weights)?;
    let result = write(
        &args,
        file,
        &opened.weights,
        opened.kernels,
        &out,
        &opened.loader,
        (opened.converted_from.as_deref(), opened.tokenizer.as_ref()),
    );
    if result.is_err() {
        // No half-written model is left behind (the sandbox may forbid removing it).
        let _ = out.set_len(0);
    }
    result
}

fn write(
    args: &QuantizeArgs,
    file: policy::FileType,
    weights: &WeightSetBox,
    kernels: Option<u_sdk::BackendBox>,
    out: &File,
    loader: &str,
    (converted_from, tokenizer): (Option<&str>, Option<&TokenizerBox>),
) -> Result<i32> {
    let e = |what: &str| {
        let loader = loader.to_string();
        let what = what.to_string();
        move |err: u_sdk::UError| anyhow!("{loader}: {what}: {err}")
    };
    let backend = kernels.context("the deployment loads no kernels plugin")?;
    let device = Device::new(backend).map_err(|err| anyhow!("kernels: {err}"))?;

    let keys = weights
        .metadata_keys()
        .into_result()
        .map_err(e("metadata"))?;
    let mut metadata: Vec<(String, MetaValue)> = Vec::with_capacity(keys.len() + 2);
    for key in keys.iter() {
        if DROPPED.contains(&key.as_str()) {
            continue;
        }
        if let Some(v) = weights
            .metadata(key.as_str().into())
            .into_result()
            .map_err(e("metadata"))?
            .into_option()
        {
            let v = if key.as_str() == "general.alignment" {
                MetaValue::UInt(gguf::ALIGNMENT)
            } else {
                v
            };
            metadata.push((key.to_string(), v));
        }
    }
    match tokenizer {
        Some(t) => {
            let vocab = t
                .gguf_metadata()
                .into_result()
                .map_err(|err| anyhow!("tokenizer: {err}"))?;
            metadata.extend(vocab.into_iter().map(|p| (p.0.into_string(), p.1)));
        }
        None if converted_from.is_some() => eprintln!(
            "u-runner quantize: warning: {} has no tokenizer.json; the GGUF has no vocabulary",
            args.input.display()
        ),
        None => {}
    }
    metadata.push(("general.quantization_version".into(), MetaValue::UInt(2)));
    metadata.push(("general.file_type".into(), MetaValue::UInt(file.id.into())));
    let meta = |k: &str| metadata.iter().find(|(key, _)| key == k).map(|(_, v)| v);
    let arch = meta("general.architecture")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    let hparam = |k: &str| {
        meta(&format!("{arch}.{k}"))
            .and_then(MetaValue::as_u64)
            .unwrap_or(0)
    };
    let layers = hparam("block_count") as u32;
    let model = policy::Model {
        is_70b: arch == "llama"
            && layers == 80
            && hparam("attention.head_count") != hparam("attention.head_count_kv"),
        arch: arch.clone(),
        layers,
        experts: hparam("expert_count") as u32,
    };

    let mut infos = weights
        .tensors()
        .into_result()
        .map_err(e("tensors"))?
        .into_vec();
    infos.sort_by(|a, b| policy::order_key(&a.name).cmp(&policy::order_key(&b.name)));
    let mut chooser = policy::Chooser::new(file, model, infos.iter().map(|t| t.name.as_str()));
    let mut plan = Vec::with_capacity(infos.len());
    for t in &infos {
        // GGUF files from ggml count dimensions up to the last one above 1, as ggml does.
        let ones = t.shape.iter().take_while(|&&d| d == 1).count();
        let dims = t.shape[ones.min(t.shape.len().saturating_sub(1))..].to_vec();
        let target = chooser
            .choose(&t.name, &dims, t.dtype)
            .map_err(|why| anyhow!("{why}"))?;
        if target != t.dtype && t.dtype.is_quantized() && !args.allow_requantize {
            bail!(
                "{} is already quantized ({}): requantizing is refused without \
                 --allow-requantize (quantize from an F32, F16 or BF16 model for the best result)",
                t.name,
                t.dtype
            );
        }
        let row = dims.last().copied().unwrap_or(1);
        let rows: u64 = dims.iter().rev().skip(1).product();
        let bytes = target
            .bytes_for(row)
            .and_then(|r| r.checked_mul(rows))
            .with_context(|| format!("{}: {target} rows of {row} values", t.name))?;
        let converts = |d: DType| {
            matches!(
                device
                    .backend()
                    .supports(u_sdk::OpKind::Copy, d)
                    .into_result(),
                Ok(true)
            )
        };
        if target != t.dtype && !converts(target) {
            bail!("the kernels plugin cannot convert {} to {target}", t.name);
        }
        plan.push(Planned {
            name: t.name.to_string(),
            dims,
            stored: t.dtype,
            target,
            bytes,
        });
    }
    for f in &chooser.fallbacks {
        eprintln!("u-runner quantize: warning: {f}");
    }
    let entries: Vec<gguf::TensorEntry> = plan
        .iter()
        .map(|p| gguf::TensorEntry {
            name: p.name.clone(),
            dims: p.dims.clone(),
            dtype: p.target,
            bytes: p.bytes,
        })
        .collect();
    let (header, skipped) = gguf::header(&metadata, &entries).map_err(|why| anyhow!("{why}"))?;
    for k in &skipped {
        eprintln!("u-runner quantize: warning: metadata key {k} is not copied");
    }

    let total: u64 = infos.iter().map(|t| t.byte_len).sum();
    let progress = progress::Line::new(total);
    let mut w = BufWriter::with_capacity(1 << 20, out);
    let failed_write = |err: std::io::Error| anyhow!("writing {}: {err}", args.output.display());
    w.write_all(&header).map_err(failed_write)?;
    let (mut done, mut written) = (0u64, header.len() as u64);
    let mut buf = Vec::new();
    for p in &plan {
        let view = weights
            .tensor(p.name.as_str().into())
            .into_result()
            .map_err(e(&p.name))?;
        if p.target == p.stored {
            gguf::write_padded(&mut w, view.data.as_slice()).map_err(failed_write)?;
            done += view.data.len() as u64;
            progress.update(done, &format!("{:<40.40}", p.name));
        } else {
            let row = p.dims.last().copied().unwrap_or(1) as usize;
            let rows = p.dims.iter().rev().skip(1).product::<u64>() as usize;
            let source = device
                .import_weight(weights, &p.name, Some(&[rows as u64, row as u64]))
                .map_err(|err| anyhow!("{}: {err}", p.name))?;
            let step = (SLAB_VALUES / row.max(1)).max(1);
            buf.clear();
            let row_in = view.data.len() as u64 / rows.max(1) as u64;
            for r in (0..rows).step_by(step) {
                let n = step.min(rows - r);
                source
                    .rows_range(r..r + n)
                    .and_then(|src| {
                        let dst = device.alloc(p.target, &[n as u64, row as u64])?;
                        src.copy_into(None, &dst)?;
                        let at = buf.len();
                        buf.resize(at + dst.desc().byte_len().unwrap_or(0) as usize, 0);
                        let into = RSliceMut::from_mut_slice(&mut buf[at..]);
                        dst.desc()
                            .buffer
                            .read(dst.desc().offset, into)
                            .into_result()
                    })
                    .map_err(|err| anyhow!("{}: converting to {}: {err}", p.name, p.target))?;
                done += n as u64 * row_in;
                progress.update(done, &format!("{:<40.40}", p.name));
            }
            gguf::write_padded(&mut w, &buf).map_err(failed_write)?;
        }
        written += p.bytes.next_multiple_of(gguf::ALIGNMENT);
    }
    w.flush().map_err(failed_write)?;
    progress.finish();
    let elements: u64 = plan.iter().map(|p| p.dims.iter().product::<u64>()).sum();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let data: u64 = plan.iter().map(|p| p.bytes).sum();
    eprintln!(
        "u-runner quantize: {} tensors, {:.2} MiB → {:.2} MiB ({:.2} bits per weight), {} ({}) \
         written to {} ({written} bytes), {} fallback(s)",
        plan.len(),
        mib(total),
        mib(data),
        data as f64 * 8.0 / elements.max(1) as f64,
        file.name,
        file.default,
        args.output.display(),
        chooser.fallbacks.len()
    );
    Ok(0)
}
