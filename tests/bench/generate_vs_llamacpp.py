#!/usr/bin/env python3
"""Decode and prefill speed of `u-runner generate` beside llama.cpp on the same GGUF file.

Runs both in one invocation with the same thread count and prints tokens/s and the ratio
U / llama.cpp for prompt processing (a ~512-token prompt) and token generation (128 greedy
tokens). llama.cpp runs through llama-cpp-python (`pip install llama-cpp-python`, which builds
llama.cpp from source). Ratios, not absolute times, are what to quote: machines here are shared.

    python3 tests/bench/generate_vs_llamacpp.py [MODEL.gguf] [--threads 2] [--runs 3]

MODEL defaults to the SmolLM2 file that `cargo xtask fetch-model` caches. llama.cpp's rates come
from its own performance counters (llama_perf_context), U's from `generate --json`. Run it on an
otherwise idle machine: llama.cpp's OpenMP threads spin, so other load hurts it far more than U.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SENTENCE = "The quick brown fox jumps over the lazy dog while the river keeps flowing. "


def default_model() -> pathlib.Path:
    cache = os.environ.get("U_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "u", "models")
    return pathlib.Path(cache) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_u(model, prompt, n, threads):
    out = subprocess.run(
        [str(ROOT / "target/release/u-runner"), "generate", "--model", str(model),
         "--prompt", prompt, "-n", str(n), "--temp", "0", "--threads", str(threads), "--json"],
        check=True, capture_output=True, text=True)
    t = json.loads(out.stdout)["timings"]
    return t["prompt_tokens"], t["prompt_tokens_per_s"], t["generated_tokens"], t["generated_tokens_per_s"]


def run_llamacpp(llm, prompt, n):
    """Greedy completion; rates from llama.cpp's own performance counters."""
    import llama_cpp

    tokens = llm.tokenize(prompt.encode(), add_bos=False)
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    llm.create_completion(tokens, max_tokens=n, temperature=0.0, top_k=1)
    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    pp = perf.n_p_eval / (perf.t_p_eval_ms / 1000.0)
    tg = perf.n_eval / (perf.t_eval_ms / 1000.0)
    return len(tokens), pp, tg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(default_model()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    import llama_cpp

    print(llama_cpp.llama_print_system_info().decode().strip())
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=2048, n_batch=512, verbose=False)
    prompt = SENTENCE * 32
    u_pp, u_tg, l_pp, l_tg = [], [], [], []
    for _ in range(args.runs):
        n_prompt, pp, _, tg = run_u(args.model, prompt, args.tokens, args.threads)
        u_pp.append(pp)
        u_tg.append(tg)
        l_prompt, pp, tg = run_llamacpp(llm, prompt, args.tokens)
        l_pp.append(pp)
        l_tg.append(tg)
    med = statistics.median
    print(f"model {args.model}, {args.threads} threads, median of {args.runs} runs")
    print(f"prompt: U {n_prompt} tokens, llama.cpp {l_prompt} tokens")
    print(f"  prefill   U {med(u_pp):8.1f} tok/s   llama.cpp {med(l_pp):8.1f} tok/s   ratio U/llama.cpp {med(u_pp) / med(l_pp):.2f}")
    print(f"  generate  U {med(u_tg):8.1f} tok/s   llama.cpp {med(l_tg):8.1f} tok/s   ratio U/llama.cpp {med(u_tg) / med(l_tg):.2f}")


if __name__ == "__main__":
    sys.exit(main())
