#!/usr/bin/env python3
"""Prompt-lookup speculative decoding: `u-runner generate` with and without drafts, beside
llama.cpp's prompt-lookup decoding (llama-cpp-python's `LlamaPromptLookupDecoding`) with and
without, on the same GGUF file, greedy, in one run.

Two prompts: a code edit (the model copies most of a function back: drafts pay) and prose (few
drafts match: speculation must back off and cost nothing). For each, decode tokens/s with and
without speculation and the ratio; U's drafted/kept counts come from `generate --json`.
Ratios, not absolute times, are what to quote: machines here are shared.

    python3 tests/bench/speculative_vs_llamacpp.py [MODEL.gguf] [--threads 2] [--runs 3]

MODEL defaults to the SmolLM2 file that `cargo xtask fetch-model` caches.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

CODE = '''def parse_config(path):
    """Read a key = value file into a dict."""
    values = {}
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"{path}:{number}: expected key = value")
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values
'''
EDIT = (
    "Here is a Python function:\n\n" + CODE + "\nHere is the same function with the variable "
    "`handle` renamed to `stream`, everything else unchanged:\n\n"
)
PROSE = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "The story begins on a cold morning in late autumn, when"
)


def default_model() -> pathlib.Path:
    cache = os.environ.get("U_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "u", "models")
    return pathlib.Path(cache) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def deployment(draft_tokens: int, folder: str) -> str:
    """manifests/dev.toml with runner-text's `draft_tokens` set (paths made absolute)."""
    text = (ROOT / "manifests/dev.toml").read_text().replace('"../', f'"{ROOT}/')
    marker = 'path = "' + str(ROOT) + '/target/plugins/runner-text.so"\n'
    assert marker in text, "runner-text is not in manifests/dev.toml"
    text = text.replace(marker, marker + f"[plugins.config]\ndraft_tokens = {draft_tokens}\n")
    path = os.path.join(folder, f"draft{draft_tokens}.toml")
    pathlib.Path(path).write_text(text)
    return path


def run_u(model, prompt, n, threads, manifest):
    out = subprocess.run(
        [str(ROOT / "target/release/u-runner"), "generate", "--model", str(model), "--prompt", prompt,
         "-n", str(n), "--temp", "0", "--threads", str(threads), "--json", "--deployment", manifest],
        check=True, capture_output=True, text=True)
    j = json.loads(out.stdout)
    t = j["timings"]
    return t["generated_tokens_per_s"], t["draft_tokens"], t["accepted_draft_tokens"], j["text"]


def run_llamacpp(llm, prompt, n):
    """Greedy completion; decode rate = generated tokens over the wall time after the prompt."""
    import llama_cpp

    tokens = llm.tokenize(prompt.encode(), add_bos=False)
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    start = time.perf_counter()
    out = llm.create_completion(tokens, max_tokens=n, temperature=0.0, top_k=1)
    wall = time.perf_counter() - start
    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    generated = out["usage"]["completion_tokens"]
    prompt_s = perf.t_p_eval_ms / 1000.0
    return generated / max(wall - prompt_s, 1e-9), out["choices"][0]["text"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(default_model()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = dict(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads,
                  n_ctx=2048, n_batch=512, verbose=False)
    plain = llama_cpp.Llama(**common)
    lookup = llama_cpp.Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4))
    med = statistics.median
    with tempfile.TemporaryDirectory() as folder:
        off, on = deployment(0, folder), deployment(4, folder)
        print(f"model {args.model}, {args.threads} threads, {args.tokens} greedy tokens, median of {args.runs} runs")
        for name, prompt in [("code edit", EDIT), ("prose", PROSE)]:
            u_off, u_on, l_off, l_on, kept = [], [], [], [], []
            for _ in range(args.runs):
                rate, _, _, text_off = run_u(args.model, prompt, args.tokens, args.threads, off)
                u_off.append(rate)
                rate, drafted, accepted, text_on = run_u(args.model, prompt, args.tokens, args.threads, on)
                u_on.append(rate)
                kept.append((accepted, drafted))
                assert text_on == text_off, "greedy output changed with speculation"
                l_off.append(run_llamacpp(plain, prompt, args.tokens)[0])
                l_on.append(run_llamacpp(lookup, prompt, args.tokens)[0])
            accepted, drafted = kept[-1]
            print(f"{name}:")
            print(f"  U          {med(u_off):7.1f} tok/s without, {med(u_on):7.1f} with drafts: "
                  f"ratio {med(u_on) / med(u_off):.2f} ({accepted} of {drafted} drafted tokens kept)")
            print(f"  llama.cpp  {med(l_off):7.1f} tok/s without, {med(l_on):7.1f} with lookup: "
                  f"ratio {med(l_on) / med(l_off):.2f}")
            print(f"  U / llama.cpp with speculation: {med(u_on) / med(l_on):.2f}")


if __name__ == "__main__":
    sys.exit(main())
