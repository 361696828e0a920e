#!/usr/bin/env python3
"""MoE decode beside llama.cpp, and what U's expert cache does: on a random-weight Mixtral-style
GGUF (8 experts, 2 routed per token, ~1.9 GB F16; tests/fixtures/gen_bench_mixtral.py).

Three parts, one run:

1. In memory: `llama-bench -p 0 -n N` beside `u-runner bench -p 0 -n N` with the expert cache
   as it ships (no budget: it counts routings, the OS pages) and with all of it off; tokens/s
   and ratios.
2. Under a memory budget (`--budget-mib`, well below the experts' bytes, so experts are read
   from the file again and again — what a model larger than RAM does): U with LRU alone, with
   pinning, with lookahead, with both; tokens/s, and per token the experts missed, the MiB
   asked for, evictions, lookahead's hit rate, and the bytes the process read from storage
   (the child's `ru_inblock`, whole run including load, over the tokens decoded).
3. Pages touched: under a budget larger than the model (so nothing is evicted, but the file is
   marked random-access as under any budget), the file dropped from the page cache
   (`posix_fadvise(DONTNEED)`), then one short decode (`-n 1`, one warm-up and one timed token), then `mincore` over the file: the
   resident share of every expert and of the dense tensors — only the routed experts (≤ 2
   tokens × 2 of 8 per layer, plus lookahead's guesses when it is on) come in, the dense
   tensors all do.
4. Decode from a cold page cache (`-n 8` after one warm-up token, `--cold-runs` times): under
   a roomy budget with lookahead off and on (the cache reads what it asks for), and with no
   budget (as shipped: the cache only counts, the OS's read-ahead pages experts in).

    python3 tests/bench/moe_vs_llamacpp.py                 # -n 64, 3 reps, budget 768 MiB
    python3 tests/bench/moe_vs_llamacpp.py -n 32 --reps 1  # quicker

Builds what is missing first (the model file, llama.cpp's tools, U; see llama_bench.py).
Machines here are shared and noisy: quote ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))
import gen_bench_llama as fixtures  # noqa: E402
import gen_bench_mixtral as mixtral  # noqa: E402
import llama_bench  # noqa: E402

SHIPPED: dict = {}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_u(runner: Path, model: Path, settings: dict, n: int, reps: int, threads: int,
          cold: bool = False) -> dict:
    """`u-runner bench -p 0 -n n` under `settings`, the file first read whole into the page
    cache (or dropped from it, `cold`): tokens/s samples, the expert counters of the timed
    reps, and the bytes the process read from storage (its rusage)."""
    dep = llama_bench.deployment_with({"arch-llama": settings})
    if cold:
        drop_page_cache(model)
    else:
        warm_page_cache(model)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    try:
        p = subprocess.run(
            [str(runner), "bench", "--model", str(model), "-p", "0", "-n", str(n),
             "--threads", str(threads), "--reps", str(reps), "--json", "--deployment", str(dep)],
            capture_output=True, text=True)
    finally:
        dep.unlink()
    blocks = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - before
    if p.returncode != 0:
        raise SystemExit(f"u-runner bench failed: {p.stderr.strip()}")
    out = p.stdout
    r = json.loads(out)[0]
    return dict(ts=r["samples_ts"], counters=r["model_counters"], tokens=n * reps,
                read_bytes=blocks * 512, all_tokens=n * (reps + 1))


def run_llama(bin_dir: Path, model: Path, n: int, reps: int, threads: int) -> list[float]:
    warm_page_cache(model)
    out = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(n), "-t",
         str(threads), "-r", str(reps), "-o", "json"],
        check=True, capture_output=True, text=True,
        env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    return json.loads(out.stdout)[0]["samples_ts"]


def drop_page_cache(path: Path) -> None:
    """Asks the OS to drop the file's clean pages (no privilege needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(path: Path) -> None:
    """Reads the whole file, so that every run starts with it in the page cache (runs under a
    budget leave parts of it paged out)."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def resident_share(path: Path) -> dict[str, float]:
    """Per tensor of the GGUF file, the share of its pages in the page cache (`mincore` over a
    fresh mapping of the whole file)."""
    import gguf

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page, size = mmap.PAGESIZE, path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        ok = libc.mincore(addr, size, vec) == 0
        libc.munmap(addr, size)
        if not ok:
            raise OSError(ctypes.get_errno(), "mincore")
    finally:
        os.close(fd)
    flags = bytes(vec)
    shares = {}
    for t in gguf.GGUFReader(path).tensors:
        first, last = t.data_offset // page, (t.data_offset + int(t.n_bytes) - 1) // page
        span = flags[first:last + 1]
        shares[t.name] = sum(b & 1 for b in span) / len(span)
    return shares


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=64, help="generated tokens per rep")
    ap.add_argument("--reps", "-r", type=int, default=3)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--budget-mib", type=int, default=768,
                    help="expert budget of part 2 (the experts take ~1.6 GB)")
    ap.add_argument("--cold-runs", type=int, default=3, help="runs of part 4 per setting")
    ap.add_argument("--isa", choices=list(fixtures.ISA_FLAGS), default=fixtures.default_isa())
    a = ap.parse_args()

    model = mixtral.ensure_model()
    bin_dir = fixtures.ensure_llama_cpp(a.isa)
    runner = llama_bench.ensure_u()
    s = mixtral.SHAPE
    print(f"bench Mixtral (~930M random weights, {s['layers']} layers, {s['experts']} experts, "
          f"{s['used']} routed, F16, {model.stat().st_size / 2**30:.2f} GiB), {a.threads} "
          f"threads, tg{a.n}, {a.reps} reps; llama.cpp {fixtures.LLAMA_CPP_PYTHON} ({a.isa})\n")

    log("part 1: in memory")
    llama = run_llama(bin_dir, model, a.n, a.reps, a.threads)
    shipped = run_u(runner, model, SHIPPED, a.n, a.reps, a.threads)
    roomy = dict(expert_budget_mb=4096)
    working = run_u(runner, model, roomy, a.n, a.reps, a.threads)
    mean = statistics.mean
    print("| in memory | t/s | U/llama.cpp |")
    print("| --- | ---: | ---: |")
    print(f"| llama.cpp | {mean(llama):.2f} | 1.00 |")
    for name, r in [("U, as shipped (no budget)", shipped),
                    ("U, budget 4096 MiB: prefetch + lookahead at work, nothing evicted", working)]:
        print(f"| {name} | {mean(r['ts']):.2f} | {mean(r['ts']) / mean(llama):.2f} |")

    log("part 2: under a budget")
    budget = dict(expert_budget_mb=a.budget_mib)
    variants = [
        ("LRU only", dict(budget, expert_lookahead=False, expert_pin_share=0)),
        ("LRU + pinning", dict(budget, expert_lookahead=False, expert_pin_share=1.5)),
        ("LRU + lookahead (as shipped)", dict(budget)),
        ("LRU + pinning + lookahead", dict(budget, expert_pin_share=1.5)),
    ]
    print(f"\n| budget {a.budget_mib} MiB | t/s | vs LRU only | misses/token | MiB asked/token "
          f"| evictions/token | lookahead hits | MiB read from storage/token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for name, settings in variants:
        r = run_u(runner, model, settings, a.n, a.reps, a.threads)
        c, t = r["counters"], r["tokens"]
        base = base or mean(r["ts"])
        hits = c["expert_predicted_hits_total"] / max(c["expert_routed_total"], 1)
        hit = f"{hits:.0%}" if c["expert_predicted_total"] else "-"
        print(f"| {name} | {mean(r['ts']):.2f} | {mean(r['ts']) / base:.2f} | "
              f"{c['expert_misses_total'] / t:.1f} | "
              f"{c['expert_fetched_bytes_total'] / t / 2**20:.1f} | "
              f"{c['expert_evictions_total'] / t:.1f} | {hit} | "
              f"{r['read_bytes'] / r['all_tokens'] / 2**20:.1f} |")

    log("part 3: pages touched")
    print("\n| decode of 2 tokens from a cold page cache, budget 4096 MiB | experts resident per "
          "layer (of 8) | "
          "expert bytes resident | dense tensors resident |")
    print("| --- | --- | ---: | ---: |")
    for name, settings in [("U, lookahead off", dict(roomy, expert_lookahead=False)),
                           ("U, lookahead on", roomy)]:
        drop_page_cache(model)
        before = resident_share(model)
        cold = sum(before.values()) / len(before)
        run_u(runner, model, settings, 1, 1, a.threads, cold=True)
        shares = resident_share(model)
        per_layer, expert_share, dense = [], [], []
        for layer in range(s["layers"]):
            tensors = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
            expert_share.extend(shares[t] for t in tensors)
            per_layer.append(round(mean(shares[t] for t in tensors) * s["experts"]))
        dense = [v for k, v in shares.items() if "_exps" not in k and k != "token_embd.weight"]
        print(f"| {name} (cold: {cold:.0%} resident before) | {per_layer} | "
              f"{mean(expert_share):.0%} | {mean(dense):.0%} |")

    log("part 4: decode from a cold page cache")
    print(f"\n| from a cold page cache, {a.cold_runs} runs | tg8 t/s (after one warm-up token) | "
          f"vs first row | MiB read from storage |")
    print("| --- | ---: | ---: | ---: |")
    base = None
    for name, settings in [("U, budget 4096 MiB, lookahead off",
                            dict(roomy, expert_lookahead=False)),
                           ("U, budget 4096 MiB, lookahead on", roomy),
                           ("U, no budget (as shipped: the OS's read-ahead)", SHIPPED)]:
        runs = [run_u(runner, model, settings, 8, 1, a.threads, cold=True)
                for _ in range(a.cold_runs)]
        ts = mean(r["ts"][0] for r in runs)
        base = base or ts
        print(f"| {name} | {ts:.2f} | {ts / base:.2f} | "
              f"{mean(r['read_bytes'] for r in runs) / 2**20:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
