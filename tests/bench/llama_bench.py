#!/usr/bin/env python3
"""U beside llama.cpp's `llama-bench` on the same GGUF files: pp512 and tg128 per weight type.

For each type (F16, Q8_0, Q4_0, Q4_K_M, Q6_K of the bench Llama that
tests/fixtures/gen_bench_llama.py makes, ~244M parameters) it runs `llama-bench -p P -n N -t T
-r R -o json` and `u-runner bench -p P -n N --threads T --reps R --json` alternately (the order
flips every round), then prints U t/s, llama.cpp t/s and the ratio U/llama.cpp for both tests.

It also measures the machine's read bandwidth — a small C program (gcc -O3 -march=native
-fopenmp) that sums a 1 GiB buffer (≫ LLC) with T threads, best of 7, before and after the runs,
the higher of the two counting (other load only lowers it) — and prints each decode
result as a fraction of the bandwidth limit, bandwidth ÷ bytes of weights read per token, where
those bytes are every tensor of the file except `token_embd.weight` (one row of it is read per
token) unless the output matrix is tied to it. KV-cache reads (< 1% here) are not counted.

    python3 tests/bench/llama_bench.py                         # all five types, 3 reps, 1 round
    python3 tests/bench/llama_bench.py --types Q4_0 --reps 1   # a quick try
    python3 tests/bench/llama_bench.py --rounds 3 --isa avx2   # both on their AVX2 paths
    python3 tests/bench/llama_bench.py --depth 4096            # at 4096 tokens of context

`--depth D` runs both at context depth D (llama-bench's `-d`, `u-runner bench -d`: D tokens
prefilled untimed before each run) with U's KV cache as `--kv-type` says (`f32`, the default,
or `int8`) and llama.cpp's F16 KV; the limit fractions then leave out the KV reads, which at
depth are no longer small (D × 16 layers × 2 × 1024 values per decoded token).

`--isa avx2` builds llama.cpp for AVX2 only and runs U's kernels on their AVX2 path (a copy of
manifests/dev.toml with kernels-cpu's `isa = "avx2"`), so an AVX-512 machine can measure what
an AVX2-only one would run.

llama.cpp runs with OMP_WAIT_POLICY=passive unless `--omp-active` is given: its OpenMP threads
otherwise spin at every barrier, and on a machine shared with other work they then collapse
(measured here at load average 5: tg64 Q4_0 13 ± 13 t/s spinning, 43 ± 1 passive), which would
flatter U. On an idle machine `--omp-active` measures llama.cpp exactly as shipped.

On first use it builds llama.cpp's tools and the model files (see gen_bench_llama.py; several
minutes), and, if `target/release/u-runner` or the signed plugins are missing, runs
`cargo xtask build`. Machines here are shared and noisy: quote the ratios, not the times, and
expect llama.cpp's spinning OpenMP threads to suffer more from other load than U's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
import gen_bench_llama as fixtures  # noqa: E402

READ_BW_C = r"""
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    size_t bytes = (size_t)atol(argv[1]) << 20, n = bytes / 8;
    uint64_t *buf = malloc(bytes);
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) buf[i] = i;
    double best = 1e30; uint64_t sink = 0;
    for (int r = 0; r < 7; r++) {
        double t = omp_get_wtime(); uint64_t s = 0;
        #pragma omp parallel for reduction(+ : s)
        for (size_t i = 0; i < n; i++) s += buf[i];
        t = omp_get_wtime() - t; sink += s;
        if (t < best) best = t;
    }
    printf("%.3f %llu\n", bytes / best / 1e9, (unsigned long long)(sink & 1));
    return 0;
}
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_bandwidth(threads: int, mib: int) -> float:
    """Best-of-7 parallel read bandwidth in GB/s over `mib` MiB."""
    exe = fixtures.bench_dir() / "read_bw"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".c") as src:
            src.write(READ_BW_C)
            src.flush()
            subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", src.name, "-o", str(exe)],
                           check=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="spread")
    out = subprocess.run([str(exe), str(mib)], check=True, capture_output=True, text=True, env=env)
    return float(out.stdout.split()[0])


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of the tensors one decode step reads: all but the embedding table, unless tied."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(b for n, b in tensors.items() if tied or n != "token_embd.weight")


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each stored type the file holds."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def ensure_u() -> Path:
    runner = ROOT / "target" / "release" / "u-runner"
    plugins = ROOT / "target" / "plugins"
    if not runner.exists() or not any(plugins.glob("*.so")):
        log("building and signing U: cargo xtask build")
        subprocess.run(["cargo", "xtask", "build"], cwd=ROOT, check=True)
    return runner


def split(results: list[dict]) -> dict[str, list[float]]:
    """Per-rep tokens/s by test name (`pp512`, `tg128`) from llama-bench-shaped JSON."""
    out: dict[str, list[float]] = {}
    for r in results:
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        if r.get("n_depth"):
            test += f" @ d{r['n_depth']}"
        out.setdefault(test, []).extend(r["samples_ts"])
    return out


def run_llama(bin_dir: Path, model: Path, a) -> tuple[dict[str, list[float]], str]:
    """llama-bench's per-rep tokens/s, and its build number and commit."""
    out = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(a.p), "-n", str(a.n),
         "-t", str(a.threads), "-r", str(a.reps), "-d", str(a.depth), "-o", "json"],
        check=True, capture_output=True, text=True,
        env=dict(os.environ) if a.omp_active else dict(os.environ, OMP_WAIT_POLICY="passive"))
    results = json.loads(out.stdout)
    # The sdist carries no git metadata: build 0, commit "unknown".
    known = results and results[0].get("build_commit", "unknown") != "unknown"
    build = f"build {results[0]['build_number']} ({results[0]['build_commit']}) " if known else ""
    return split(results), build


def deployment_with(configs: dict[str, dict]) -> Path:
    """A copy of manifests/dev.toml (beside it, so its relative paths hold) in which each plugin
    named in `configs` (`kernels-cpu`…) gets that table as its `[plugins.config]`. The caller
    removes it."""
    dev = ROOT / "manifests" / "dev.toml"
    text = dev.read_text()
    for plugin, settings in configs.items():
        line = f'path = "../target/plugins/{plugin}.so"\n'
        assert line in text, f"manifests/dev.toml loads {plugin}"
        table = "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
        text = text.replace(line, line + "[plugins.config]\n" + table)
    fd, name = tempfile.mkstemp(prefix=".bench-", suffix=".toml", dir=dev.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(name)


def deployment_for(isa: str, kv_type: str) -> Path | None:
    """For `--isa avx2` or `--kv-type int8`, a copy of manifests/dev.toml whose kernels-cpu runs
    the AVX2 path even on an AVX-512 machine, or whose cache-kv stores int8 KV; else None (U's
    best path, f32 KV)."""
    configs: dict[str, dict] = {}
    if isa == "avx2":
        configs["kernels-cpu"] = dict(isa="avx2")
    if kv_type != "f32":
        configs["cache-kv"] = dict(kv_dtype=kv_type)
    return deployment_with(configs) if configs else None


def run_u(runner: Path, model: Path, a) -> dict[str, list[float]] | str:
    """U's per-rep tokens/s, or its error message."""
    deployment = deployment_for(a.isa, a.kv_type)
    extra = ["--deployment", str(deployment)] if deployment else []
    try:
        out = subprocess.run(
            [str(runner), "bench", "--model", str(model), "-p", str(a.p), "-n", str(a.n),
             "-d", str(a.depth), "--threads", str(a.threads), "--reps", str(a.reps), "--json",
             *extra],
            capture_output=True, text=True)
    finally:
        if deployment:
            deployment.unlink()
    if out.returncode != 0:
        return out.stderr.strip() or f"exit status {out.returncode}"
    return split(json.loads(out.stdout))


def fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):8.2f} ± {sd:6.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(fixtures.TYPES),
                    help="comma-separated subset of " + ",".join(fixtures.TYPES))
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (pp test)")
    ap.add_argument("-n", type=int, default=128, help="generated tokens (tg test)")
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--reps", "-r", type=int, default=3, help="repetitions per run of each tool")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternating runs of both tools per type (order flips each round)")
    ap.add_argument("--isa", choices=list(fixtures.ISA_FLAGS), default=fixtures.default_isa(),
                    help="llama.cpp build: AVX-512 (+VNNI, BF16; no AMX), or AVX2/FMA/F16C "
                         "like the pip build (see gen_bench_llama.py)")
    ap.add_argument("--omp-active", action="store_true",
                    help="let llama.cpp's OpenMP threads spin (its default; for idle machines)")
    ap.add_argument("--depth", "-d", type=int, default=0,
                    help="context depth: tokens prefilled (untimed) before each test")
    ap.add_argument("--kv-type", choices=["f32", "int8"], default="f32",
                    help="U's KV cache type (llama.cpp keeps its F16 default)")
    ap.add_argument("--bw-mib", type=int, default=1024, help="buffer of the bandwidth test")
    ap.add_argument("--json-out", type=Path, help="also write all samples here")
    a = ap.parse_args()

    types = a.types.split(",")
    bin_dir = fixtures.ensure_llama_cpp(a.isa)
    models = fixtures.ensure_models(types, a.isa)
    runner = ensure_u()
    bws = [read_bandwidth(a.threads, a.bw_mib)]
    log(f"read bandwidth: {bws[0]:.1f} GB/s ({a.threads} threads, {a.bw_mib} MiB)")

    rows = {}
    build = ""
    for t in types:
        model = models[t]
        u: dict[str, list[float]] = {}
        ll: dict[str, list[float]] = {}
        error = None
        for rnd in range(a.rounds):
            order = ["llama", "u"] if rnd % 2 == 0 else ["u", "llama"]
            for who in order:
                tool = "llama-bench" if who == "llama" else "u-runner bench"
                log(f"{t}: round {rnd + 1}/{a.rounds}: {tool}")
                if who == "llama":
                    got, build = run_llama(bin_dir, model, a)
                    for k, v in got.items():
                        ll.setdefault(k, []).extend(v)
                elif error is None:
                    got = run_u(runner, model, a)
                    if isinstance(got, str):
                        error = got
                    else:
                        for k, v in got.items():
                            u.setdefault(k, []).extend(v)
        rows[t] = dict(model=str(model), size=model.stat().st_size, types=tensor_types(model),
                       bytes_per_token=weight_bytes_per_token(model), u=u, llama=ll, error=error)

    bws.append(read_bandwidth(a.threads, a.bw_mib))
    bw = max(bws)
    at = f" @ d{a.depth}" if a.depth else ""
    pp, tg = f"pp{a.p}{at}", f"tg{a.n}{at}"
    shape = ", ".join(f"{k} {v}" for k, v in fixtures.SHAPE.items())
    print(f"\nbench Llama ~244M ({shape}), {a.threads} threads, {a.reps} reps x {a.rounds} "
          f"round(s); llama.cpp {build}from the llama-cpp-python {fixtures.LLAMA_CPP_PYTHON} "
          f"sdist, {a.isa} build, U on its {'AVX2' if a.isa == 'avx2' else 'best'} path, "
          f"OMP_WAIT_POLICY={'default' if a.omp_active else 'passive'}, "
          f"U KV {a.kv_type}, llama.cpp KV f16")
    print(f"read bandwidth {bw:.1f} GB/s (before {bws[0]:.1f}, after {bws[1]:.1f}; {a.threads} "
          f"threads, {a.bw_mib} MiB); tg limit = bandwidth / weight bytes per token\n")
    head = ("| type   | test  | U t/s             | llama.cpp t/s     | U/llama.cpp | "
            "MiB/token | limit t/s | U of limit | llama.cpp of limit |")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    mean = statistics.mean
    for t, r in rows.items():
        for test in (pp, tg):
            us, ls = r["u"].get(test, []), r["llama"].get(test, [])
            ratio = f"{mean(us) / mean(ls):11.2f}" if us and ls else "          -"
            extra = "|           |           |            |                    |"
            if test == tg:
                limit = bw * 1e9 / r["bytes_per_token"]
                uf = f"{mean(us) / limit:10.0%}" if us else "         -"
                lf = f"{mean(ls) / limit:18.0%}" if ls else "                 -"
                extra = f"| {r['bytes_per_token'] / 2**20:9.1f} | {limit:9.1f} | {uf} | {lf} |"
            print(f"| {t:<6} | {test:<5} | {fmt(us):<17} | {fmt(ls):<17} | {ratio} {extra}")
    for t, r in rows.items():
        if r["error"]:
            print(f"\n{t}: U failed: {r['error']}")
    print("\ntensor types per file: " + "; ".join(
        f"{t}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["types"].items()))
        for t, r in rows.items()))
    if a.json_out:
        a.json_out.write_text(json.dumps(dict(bandwidth_gbs=bws, threads=a.threads, rows=rows),
                                         indent=1))
    return 1 if any(r["error"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
