#!/usr/bin/env python3
"""Fork isolation beside thread mode: `u-runner serve` on the same GGUF file, 2 threads, the
same warm-up prompt, run one mode after the other.

Prints, per mode:
- time to first token of single streamed requests that share the warm-up prompt as their
  prefix (median of `--requests`; in fork mode each runs in a pre-forked session process);
- aggregate generated tokens/s of 8 concurrent clients for `--seconds` (each request a prompt
  of its own, greedy, `max_tokens` 64, end-of-sequence ignored: serve_vs_llama_server's load);
then fork/thread for both. And, for fork mode with N = 1, 8 and 32 sessions forked ahead
(`fork_pool`), the memory of the whole process tree from `/proc/<pid>/smaps_rollup`: total
PSS beside the model file's size, the parent's PSS, and the private pages each idle session
adds.

    python3 tests/bench/fork_vs_thread.py [MODEL.gguf] [--seconds 20] [--pools 1,8,32]

MODEL defaults to the SmolLM2 file `cargo xtask fetch-model` caches; U needs `cargo xtask
build`. Quote the ratios: the machines here are shared.
"""
import argparse
import http.client
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import serve_vs_llama_server as serving  # noqa: E402

ROOT = serving.ROOT
SYSTEM = ("You are a careful assistant. Answer in plain sentences, cite no sources, and keep "
          "every answer short and kind. ") * 4


def runner_config(fork_pool: int) -> str:
    """runner-text's grants and config for fork mode with `fork_pool` sessions (0: thread mode)."""
    if not fork_pool:
        return ""
    return (f'[plugins.grants]\nprocess.fork = true\n[plugins.config]\nisolation = "fork"\n'
            f'fork_pool = {fork_pool}\nwarm_prompt = {json.dumps(SYSTEM)}\n'
            f'session_memory_mb = 1024\n')


def start(folder: pathlib.Path, model: pathlib.Path, fork_pool: int):
    port = serving.free_port()
    manifest = serving.u_deployment(folder, model, port, 8, runner_config(fork_pool))
    log = open(folder / f"u-{fork_pool}.log", "w")
    proc = subprocess.Popen([str(ROOT / "target/release/u-runner"), "serve", "--strict",
                             str(manifest)], stdout=subprocess.DEVNULL, stderr=log)
    serving.wait_ready(port, proc)
    return proc, port


def warm_thread_mode(port: int, name: str) -> None:
    """Thread mode's warm-up: the shared prefix prefilled once, as fork mode's parent does."""
    body = json.dumps(dict(model=name, prompt=SYSTEM, max_tokens=1, temperature=0))
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    c.getresponse().read()


def model_name(port: int) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/v1/models")
    return json.loads(c.getresponse().read())["data"][0]["id"]


def ttft(port: int, name: str, n: int) -> float:
    times = []
    for i in range(n):
        _, first = serving.one_request(port, f"{SYSTEM}Question {i}: what is {i} + {i}?", name)
        times.append(first)
    return statistics.median(times)


def aggregate(port: int, name: str, seconds: float) -> float:
    tps, _, _ = serving.load(port, 8, seconds, name)
    return tps


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in pathlib.Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def rollup(pid: int) -> dict[str, int]:
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields


def memory(folder: pathlib.Path, model: pathlib.Path, pool: int) -> str:
    proc, _ = start(folder, model, pool)
    try:
        time.sleep(3)
        pids = tree(proc.pid)
        sessions = pids[2:]
        rolls = {p: rollup(p) for p in pids}
        total = sum(r["Pss"] for r in rolls.values())
        private = [rolls[p]["Private_Clean"] + rolls[p]["Private_Dirty"] for p in sessions]
        mib = 1 << 20
        return (f"| {pool:>4} | {len(sessions):>8} | {total / mib:>9.1f} | "
                f"{model.stat().st_size / mib:>10.1f} | {rolls[proc.pid]['Pss'] / mib:>10.1f} | "
                f"{statistics.mean(private) / mib if private else 0:>16.2f} |")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=pathlib.Path)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--requests", type=int, default=9)
    ap.add_argument("--pools", default="1,8,32")
    a = ap.parse_args()
    model = (a.model or serving.default_model()).resolve()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="u-fork-bench-"))
    results = {}
    for mode, pool in [("thread", 0), ("fork", 2)]:
        proc, port = start(folder, model, pool)
        try:
            name = model_name(port)
            if pool == 0:
                warm_thread_mode(port, name)
            results[mode] = (ttft(port, name, a.requests), aggregate(port, name, a.seconds))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        print(f"{mode}: TTFT p50 {results[mode][0] * 1000:.1f} ms, 8 clients "
              f"{results[mode][1]:.1f} tokens/s", flush=True)
    (t_ttft, t_tps), (f_ttft, f_tps) = results["thread"], results["fork"]
    print(f"\nmodel {model.name}, 2 threads, shared prefix {len(SYSTEM)} characters")
    print("| mode | TTFT p50 ms | 8 clients tokens/s |\n|---|---|---|")
    print(f"| thread | {t_ttft * 1000:.1f} | {t_tps:.1f} |")
    print(f"| fork | {f_ttft * 1000:.1f} | {f_tps:.1f} |")
    print(f"| fork/thread | {f_ttft / t_ttft:.2f} | {f_tps / t_tps:.2f} |\n")
    print("| pool | sessions | total PSS MiB | model MiB | parent PSS MiB | private MiB/session |")
    print("|---|---|---|---|---|---|")
    for pool in [int(p) for p in a.pools.split(",")]:
        print(memory(folder, model, pool), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
