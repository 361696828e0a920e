#!/usr/bin/env python3
"""`u-runner perplexity` beside llama.cpp's `llama-perplexity`: same GGUF, text, context, threads.

For each model it runs both (llama.cpp first, then U) over the same text and prints the two
final estimates, how far apart they are in %, and U's speed as a multiple of llama.cpp's. By
default the models are the bench Llama of tests/fixtures/gen_bench_llama.py at F16 (#14: within
0.1%; no int8 activation rounding on either side there, though llama.cpp rounds activations to
f16 for its F16 dot products where U keeps them f32) and Q8_0, and SmolLM2, the Q4_1 default
(#14: within 0.5%); the text is Macbeth (tests/fixtures/text/macbeth.txt).

    python3 tests/bench/perplexity_vs_llamacpp.py                      # bench F16, Q8_0 + SmolLM2
    python3 tests/bench/perplexity_vs_llamacpp.py --types F16 --chunks 8 --no-smollm2
    python3 tests/bench/perplexity_vs_llamacpp.py --model other.gguf   # any GGUF, both sides

llama.cpp's tools are built on first use from the llama-cpp-python 0.3.36 sdist (see
gen_bench_llama.py, `--isa avx2|avx512`), and `cargo xtask build` runs if u-runner is missing.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
import gen_bench_llama as fixtures  # noqa: E402

TEXT = ROOT / "tests" / "fixtures" / "text" / "macbeth.txt"


def u_runner() -> Path:
    exe = ROOT / "target" / "release" / "u-runner"
    if not exe.exists() or not (ROOT / "target" / "plugins").exists():
        subprocess.run(["cargo", "xtask", "build"], cwd=ROOT, check=True)
    return exe


def llama_cpp(exe: Path, model: Path, args: argparse.Namespace) -> tuple[float, float, float]:
    cmd = [str(exe), "-m", str(model), "-f", str(args.text), "-c", str(args.ctx),
           "-t", str(args.threads)]
    if args.chunks:
        cmd += ["--chunks", str(args.chunks)]
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - start
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", p.stdout + p.stderr)
    if p.returncode != 0 or not m:
        sys.exit(f"llama-perplexity failed on {model}:\n{p.stderr[-3000:]}")
    return float(m.group(1)), float(m.group(2)), secs


def u(model: Path, args: argparse.Namespace) -> tuple[float, float, float]:
    cmd = [str(u_runner()), "perplexity", "--model", str(model), "-f", str(args.text),
           "-c", str(args.ctx), "--threads", str(args.threads), "--json",
           "--deployment", str(ROOT / "manifests" / "dev.toml")]
    if args.chunks:
        cmd += ["--chunks", str(args.chunks)]
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - start
    if p.returncode != 0:
        sys.exit(f"u-runner perplexity failed on {model}:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout)
    return r["ppl"], r["ppl_error"] or 0.0, secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="F16,Q8_0", help="bench model types (gen_bench_llama.py)")
    ap.add_argument("--model", type=Path, action="append", help="a GGUF to run instead")
    ap.add_argument("--no-smollm2", action="store_true", help="leave out the default model")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, help="chunks per run (default: the whole text)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", choices=list(fixtures.ISA_FLAGS), default=fixtures.default_isa())
    args = ap.parse_args()

    exe = fixtures.ensure_llama_cpp(args.isa, ("llama-perplexity", "llama-quantize"))
    models = list(args.model or [])
    if not args.model:
        types = [t for t in args.types.split(",") if t]
        models += list(fixtures.ensure_models(types, args.isa).values()) if types else []
        if not args.no_smollm2:
            models.append(Path(subprocess.run(["cargo", "xtask", "fetch-model"], cwd=ROOT,
                                              check=True, capture_output=True,
                                              text=True).stdout.strip()))
    print(f"text {args.text.name}, -c {args.ctx}, {args.threads} threads, llama.cpp "
          f"{fixtures.LLAMA_CPP_PYTHON} ({args.isa})")
    print(f"{'model':44} {'U PPL':>12} {'llama.cpp PPL':>14} {'apart':>8} {'U speed':>8}")
    for m in models:
        theirs = llama_cpp(exe / "llama-perplexity", m, args)
        ours = u(m, args)
        apart = 100 * abs(ours[0] - theirs[0]) / theirs[0]
        print(f"{m.name:44} {ours[0]:12.4f} {theirs[0]:14.4f} {apart:7.3f}% "
              f"{theirs[2] / ours[2]:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
