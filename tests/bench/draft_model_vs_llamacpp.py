#!/usr/bin/env python3
"""Draft-model speculative decoding: `u-runner generate --draft-model` beside llama.cpp's
`llama-speculative-simple` on the same target and draft GGUF files, greedy, in one run, each
with and without the draft.

The pair: SmolLM2-135M-Instruct as F16 (the target, 257 MiB read per token) drafted by the
same model's Q4_1 file (92 MiB) — the only model family the registries ship, so the target is
the draft's own weights dequantized (`u-runner quantize --allow-requantize … F16`, byte-identical
to `llama-quantize --allow-requantize`), written into the bench cache on first use. A draft
3× cheaper than its target bounds what speculation can gain here; the ratios are what to
compare.

For U: `generate --json` with runner-text's `draft_tokens = K` and `--draft-model`, and with
`draft_tokens = 0` (no drafting at all) as the baseline; the greedy text must not change. For
llama.cpp: `llama-speculative-simple -m TARGET -md DRAFT --spec-type draft-simple
--spec-draft-n-max K` (its other draft settings at their defaults) and `llama-completion` on
the target alone; both report the decode rate after the prompt. Ratios, not absolute times, are what to quote: machines here are shared.

    python3 tests/bench/draft_model_vs_llamacpp.py [--threads 2] [--runs 3] [--draft-tokens 6]

llama.cpp's tools are built on first use from the llama-cpp-python 0.3.36 sdist (AVX2 build,
see tests/fixtures/gen_bench_llama.py).
"""
import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
import gen_bench_llama as fixtures  # noqa: E402
from speculative_vs_llamacpp import deployment  # noqa: E402

PROMPTS = [
    ("story", "Once upon a time, in a small village by the sea,"),
    ("history", "The history of the Roman Empire begins with"),
    ("recipe", "Here is a recipe for chocolate chip cookies. Ingredients:"),
]


def models() -> tuple[pathlib.Path, pathlib.Path]:
    draft = pathlib.Path(subprocess.run(
        ["cargo", "xtask", "fetch-model", "smollm2"], cwd=ROOT, check=True,
        capture_output=True, text=True).stdout.strip())
    target = fixtures.bench_dir() / "SmolLM2-135M-Instruct.F16.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(ROOT / "target/release/u-runner"), "quantize", "--allow-requantize",
                        str(draft), str(target), "F16"], check=True)
    return target, draft


def run_u(target, draft, prompt, a, manifest):
    extra = ["--draft-model", str(draft)] if draft else []
    out = subprocess.run(
        [str(ROOT / "target/release/u-runner"), "generate", "--model", str(target), "--prompt",
         prompt, "-n", str(a.tokens), "--temp", "0", "--threads", str(a.threads), "--json",
         "--deployment", manifest, *extra],
        check=True, capture_output=True, text=True)
    j = json.loads(out.stdout)
    t = j["timings"]
    return t["generated_tokens_per_s"], t["draft_tokens"], t["accepted_draft_tokens"], j["text"]


def run_llama_speculative(bin_dir, target, draft, prompt, a):
    out = subprocess.run(
        [str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
         "--spec-type", "draft-simple",
         "-p", prompt, "-n", str(a.tokens), "-t", str(a.threads), "-td", str(a.threads),
         "--temp", "0", "--spec-draft-n-max", str(a.draft_tokens), "-c", "2048", "-fa", "off"],
        check=True, capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    log = out.stdout + out.stderr
    rate = float(re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+)", log)[1])
    drafted = int(re.search(r"n_drafted\s*=\s*(\d+)", log)[1])
    accepted = int(re.search(r"n_accept\s*=\s*(\d+)", log)[1])
    return rate, drafted, accepted


def run_llama_plain(bin_dir, target, prompt, a):
    out = subprocess.run(
        [str(bin_dir / "llama-completion"), "-m", str(target), "-p", prompt, "-n", str(a.tokens),
         "-t", str(a.threads), "--temp", "0", "-c", "2048", "-fa", "off", "-no-cnv",
         "--ignore-eos"],
        check=True, capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    log = out.stdout + out.stderr
    return float(re.search(r"\beval time =.*?([\d.]+) tokens per second", log)[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=6, help="most tokens per draft (both)")
    a = ap.parse_args()
    bin_dir = fixtures.ensure_llama_cpp(
        "avx2", ("llama-speculative-simple", "llama-completion"))
    target, draft = models()
    med = statistics.median
    print(f"target {target.name}, draft {draft.name}, {a.threads} threads, {a.tokens} greedy "
          f"tokens, drafts of up to {a.draft_tokens}, median of {a.runs} runs; llama.cpp "
          f"{fixtures.LLAMA_CPP_PYTHON} sdist, AVX2 build")
    with tempfile.TemporaryDirectory() as folder:
        off, on = deployment(0, folder), deployment(a.draft_tokens, folder)
        for name, prompt in PROMPTS:
            u_off, u_on, l_off, l_on = [], [], [], []
            for _ in range(a.runs):
                rate, _, _, text_off = run_u(target, None, prompt, a, off)
                u_off.append(rate)
                rate, drafted, accepted, text_on = run_u(target, draft, prompt, a, on)
                u_on.append(rate)
                assert text_on == text_off, "greedy output changed with the draft model"
                l_off.append(run_llama_plain(bin_dir, target, prompt, a))
                rate, l_drafted, l_accepted = run_llama_speculative(
                    bin_dir, target, draft, prompt, a)
                l_on.append(rate)
            print(f"{name}:")
            print(f"  U          {med(u_off):7.1f} tok/s without, {med(u_on):7.1f} with the draft "
                  f"model: ratio {med(u_on) / med(u_off):.2f} ({accepted} of {drafted} kept)")
            print(f"  llama.cpp  {med(l_off):7.1f} tok/s without, {med(l_on):7.1f} with the draft "
                  f"model: ratio {med(l_on) / med(l_off):.2f} ({l_accepted} of {l_drafted} kept)")
            print(f"  U / llama.cpp with speculation: {med(u_on) / med(l_on):.2f}, "
                  f"without: {med(u_off) / med(l_off):.2f}")


if __name__ == "__main__":
    sys.exit(main())
