#!/usr/bin/env python3
"""What a loader in a worker process costs: `u-runner generate -n 1` on the same GGUF files with
the development deployment as shipped (loader in the host's process) and with its GGUF loader
isolated (`isolation = "worker"`), runs interleaved.

Prints, per model: the median wall time of each (start, verify, fork the worker, parse, share
the weights through the memfd, map, build, one token), worker/in-process, and the highest
resident set of any process of the run (the host, or the worker while it copies), each beside
the model file's size.

    python3 tests/bench/worker_load.py [MODEL.gguf ...] [--runs 7]

MODEL defaults to the SmolLM2 file `cargo xtask fetch-model` caches; U needs `cargo xtask
build`. Quote the ratios: the machines here are shared.
"""
import argparse
import os
import pathlib
import statistics
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNNER = ROOT / "target/release/u-runner"
SMOLLM2 = pathlib.Path.home() / ".cache/u/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def deployment(dir: pathlib.Path, isolated: bool) -> pathlib.Path:
    """manifests/dev.toml with absolute paths, its GGUF loader in a worker when `isolated`."""
    text = (ROOT / "manifests/dev.toml").read_text()
    text = text.replace('"../', f'"{ROOT}/')
    if isolated:
        text = text.replace('loader-gguf.so"\n', 'loader-gguf.so"\nisolation = "worker"\n')
    path = dir / ("worker.toml" if isolated else "in-process.toml")
    path.write_text(text)
    return path


def one_run(model: pathlib.Path, manifest: pathlib.Path) -> tuple[float, int]:
    """Wall seconds of one `generate -n 1` in a fresh process group, and the largest resident
    set (KiB) of a process it started."""
    script = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    cmd = [str(RUNNER), "generate", "--model", str(model), "--deployment", str(manifest),
           "--prompt", "Hello", "-n", "1", "--temp", "0"]
    out = subprocess.run(["python3", "-c", script, *cmd], check=True, capture_output=True,
                         text=True).stdout.split()
    return float(out[0]), int(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", type=pathlib.Path, default=[SMOLLM2])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        modes = {"in-process": deployment(pathlib.Path(tmp), False),
                 "worker": deployment(pathlib.Path(tmp), True)}
        print(f"{'model':<36} {'MiB':>6} {'in-process s':>13} {'worker s':>9} {'ratio':>6} "
              f"{'max RSS in/worker MiB':>22}")
        for model in args.models:
            times = {m: [] for m in modes}
            rss = {m: 0 for m in modes}
            for m, manifest in modes.items():
                one_run(model, manifest)  # page cache warm for both
            for _ in range(args.runs):
                for m, manifest in modes.items():
                    t, r = one_run(model, manifest)
                    times[m].append(t)
                    rss[m] = max(rss[m], r)
            med = {m: statistics.median(v) for m, v in times.items()}
            size = os.path.getsize(model) / 2**20
            print(f"{model.name:<36} {size:>6.0f} {med['in-process']:>13.3f} {med['worker']:>9.3f} "
                  f"{med['worker'] / med['in-process']:>6.2f} "
                  f"{rss['in-process'] / 1024:>10.0f} / {rss['worker'] / 1024:<10.0f}")


if __name__ == "__main__":
    main()
