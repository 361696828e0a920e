//! `u-runner image`: an image from a prompt (or from an initial image and a prompt) with a
//! diffusion pipeline, wired as for `generate` (the diffusers folder's denoiser, text encoder,
//! autoencoder and tokenizer, the image runner); a progress bar per denoising step on stderr.
//! The host may write in `--out`'s folder after lock-down, and writes the PNG there once the
//! image is made (a failed run leaves an existing file as it was).

use anyhow::{Context, Result, bail};
use std::{io::Read, path::PathBuf, time::Instant};
use u_attest::deployment::PathGrant;
use u_runner::{progress::Line, wiring};
use u_sdk::{ImageProgress, ImageSink, ImageSinkBox};

/// The largest initial image read (256 MiB).
const MAX_IMAGE_BYTES: u64 = 256 << 20;

/// Arguments of `u-runner image`.
#[derive(clap::Args)]
pub struct ImageArgs {
    /// What the image shows (a text-conditioned pipeline's prompt; a class-conditioned
    /// pipeline's label name, from `model_index.json`'s `id2label`).
    #[arg(long, default_value = "")]
    prompt: String,
    /// The pipeline: a diffusers folder (`model_index.json`, `unet/` or `transformer/`,
    /// `vae/`, `scheduler/`, and `text_encoder/` and `tokenizer/` where text-conditioned; a
    /// component folder with only its `config.json` is read from the single-file checkpoint
    /// beside `model_index.json`), or a pixel-space consistency model (an ONNX file).
    #[arg(long)]
    model: PathBuf,
    /// Where the PNG goes.
    #[arg(long)]
    out: PathBuf,
    /// What the image should not show.
    #[arg(long, default_value = "")]
    negative_prompt: String,
    /// Denoising steps.
    #[arg(long, default_value_t = 30)]
    steps: u32,
    /// The seed: the same seed and settings give the same image.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Classifier-free guidance scale (at most 1: no guidance).
    #[arg(long, default_value_t = 7.5)]
    guidance: f32,
    /// Width in pixels [default: the pipeline's].
    #[arg(long, default_value_t = 0)]
    width: u32,
    /// Height in pixels [default: the pipeline's].
    #[arg(long, default_value_t = 0)]
    height: u32,
    /// Start from this image (PNG, JPEG, WebP, GIF, BMP) instead of noise.
    #[arg(long)]
    init_image: Option<PathBuf>,
    /// With `--init-image`: how much of it is noised away, in (0, 1].
    #[arg(long, default_value_t = 0.8)]
    strength: f32,
    /// Values a directly conditioned model reads besides its noise level, comma-separated (a
    /// DiT pipeline's class label; the terrain model's difficulty, 0 to 1).
    #[arg(long, value_delimiter = ',')]
    conditioning: Vec<f32>,
    /// Compute threads [default: the deployment's, else all cores].
    #[arg(long)]
    threads: Option<u32>,
    /// The deployment [default: as for `generate`].
    #[arg(long)]
    deployment: Option<PathBuf>,
}

/// Draws the step bar.
struct Bar(Line);

impl ImageSink for Bar {
    fn step(&mut self, p: &ImageProgress) -> bool {
        let what = format!("step {}/{}", p.step, p.steps);
        self.0.update(u64::from(p.step), &what);
        true
    }
}

/// Generates the image and writes it; speed goes to stderr.
pub fn run(args: ImageArgs) -> Result<i32> {
    let mut init = Vec::new();
    if let Some(path) = &args.init_image {
        std::fs::File::open(path)
            .with_context(|| format!("opening {}", path.display()))?
            .take(MAX_IMAGE_BYTES + 1)
            .read_to_end(&mut init)
            .with_context(|| format!("reading {}", path.display()))?;
        if init.len() as u64 > MAX_IMAGE_BYTES {
            bail!("{} is larger than {MAX_IMAGE_BYTES} bytes", path.display());
        }
    }
    let d = crate::load_default(args.deployment)?;
    let threads = args.threads.unwrap_or_else(|| crate::threads(&d)).max(1);
    let out = u_attest::deployment::absolute(&args.out);
    let folder = PathGrant {
        path: out.parent().context("--out names no file")?.to_path_buf(),
        recursive: true,
    };
    let opened =
        wiring::open_writing(&d, &args.model, threads, wiring::Want::Engine, vec![folder])?;
    let (runner, engine) = opened.engine.context("no engine was started")?;
    let request = u_sdk::ImageRequest {
        model: wiring::served_name(&u_attest::deployment::absolute(&args.model)).into(),
        prompt: args.prompt.into(),
        negative_prompt: args.negative_prompt.into(),
        width: args.width,
        height: args.height,
        steps: args.steps,
        guidance_scale: args.guidance,
        seed: args.seed,
        init_image: init.into(),
        strength: args.strength,
        handoff_prompt: "".into(),
        handoff_step: 0,
        conditioning: args.conditioning.into(),
        client: "".into(),
    };
    let start = Instant::now();
    let steps = u64::from(args.steps);
    let image = engine.generate_image(&request, ImageSinkBox::new(Bar(Line::new(steps))));
    // Ends the bar's line.
    Line::new(steps).finish();
    let image = image
        .into_result()
        .map_err(|e| anyhow::anyhow!("{runner}: {e}"))?;
    let seconds = start.elapsed().as_secs_f64();
    std::fs::write(&out, image.png.as_slice())
        .with_context(|| format!("writing {}", out.display()))?;
    let ran = image.steps - image.cached_steps;
    eprintln!(
        "{}×{} image, {} steps in {seconds:.3} s ({:.3} s per step; {threads} threads), written to {}",
        image.width,
        image.height,
        image.steps,
        seconds / f64::from(ran.max(1)),
        out.display()
    );
    Ok(0)
}
