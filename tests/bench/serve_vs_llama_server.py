#!/usr/bin/env python3
"""Serving under load: `u-runner serve` beside llama.cpp's `llama-server`, same GGUF file, same
compute threads and the same number of parallel slots, N concurrent clients each sending one
streamed `/v1/completions` request after another, in one run.

For N = 1, 16 and 64 (`--clients`) each server is started with N slots (U: `[model]
max_running = N`; llama-server: `-np N`, `-c` N × 512 so every slot holds a request) and 2
threads; N client threads then send requests for `--seconds`, each with a prompt of its own
(no two share a prefix, so neither server's prompt cache helps) and `max_tokens` 64, greedy,
end-of-sequence ignored. Printed per server and N: aggregate generated tokens/s (tokens
streamed back ÷ wall time), requests done, and time to first token p50/p99; then U/llama-server
for the aggregate. Ratios, not absolute times, are what to quote: machines here are shared.

    python3 tests/bench/serve_vs_llama_server.py [MODEL.gguf] [--clients 1,16,64] [--seconds 20]

MODEL defaults to the SmolLM2 file that `cargo xtask fetch-model` caches. llama-server is built
on first use from the llama-cpp-python 0.3.36 sdist (AVX2 build, see
tests/fixtures/gen_bench_llama.py); U needs `cargo xtask build`.
"""
import argparse
import http.client
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
import gen_bench_llama as fixtures  # noqa: E402

MAX_TOKENS = 64
TOPICS = ["the sea", "a city at night", "an old clock", "the first snow", "a lost key",
          "a mountain road", "a quiet library", "a summer storm"]


def default_model() -> pathlib.Path:
    return pathlib.Path(subprocess.run(
        ["cargo", "xtask", "fetch-model", "smollm2"], cwd=ROOT, check=True,
        capture_output=True, text=True).stdout.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def u_deployment(folder: pathlib.Path, model: pathlib.Path, port: int, slots: int,
                 runner: str = "") -> pathlib.Path:
    """The bench deployment: `slots` running requests, 4x as many queued; `runner` is appended
    to runner-text's `[[plugins]]` entry (its grants and config tables)."""
    plugins = ROOT / "target" / "plugins"
    kv = folder / "kv"
    text = f'''[deployment]
name = "bench"
threads = 2

[[trust]]
name = "u-dev"
key_file = "{ROOT / "target/dev-keys/dev.pub"}"

[[plugins]]
path = "{plugins / "loader-gguf.so"}"
[plugins.grants]
fs.read = ["{model}"]

[[plugins]]
path = "{plugins / "tokenizer.so"}"
[plugins.grants]
fs.read = ["{model}"]

[[plugins]]
path = "{plugins / "kernels-cpu.so"}"

[[plugins]]
path = "{plugins / "arch-llama.so"}"

[[plugins]]
path = "{plugins / "cache-kv.so"}"
[plugins.grants]
fs.read = ["{kv}/**"]
fs.write = ["{kv}/**"]

[[plugins]]
path = "{plugins / "runner-text.so"}"
{runner}
[[plugins]]
path = "{plugins / "transport-http.so"}"
[plugins.grants]
net.listen = ["tcp:127.0.0.1:{port}"]
fs.read = ["{folder / "secrets"}/**"]

[model]
path = "{model}"
max_running = {slots}
max_queued = {4 * slots}
'''
    path = folder / f"bench-{slots}.toml"
    path.write_text(text)
    return path


def start_u(folder, model, slots):
    port = free_port()
    manifest = u_deployment(folder, model, port, slots)
    log = open(folder / f"u-{slots}.log", "w")
    proc = subprocess.Popen([str(ROOT / "target/release/u-runner"), "serve", "--strict",
                             str(manifest)], stdout=subprocess.DEVNULL, stderr=log)
    return proc, port


def start_llama(bin_dir, model, slots, threads):
    port = free_port()
    log = open(os.devnull, "w")
    proc = subprocess.Popen(
        [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port",
         str(port), "-np", str(slots), "-c", str(512 * slots), "-t", str(threads), "-tb",
         str(threads), "-fa", "off", "--no-webui"],
        stdout=log, stderr=log, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    return proc, port


def wait_ready(port, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready")


def one_request(port, prompt, model_name):
    """Streams one completion; (tokens received, seconds to the first token)."""
    body = json.dumps(dict(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                           temperature=0, ignore_eos=True))
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    tokens, first = 0, None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if any(c.get("text") for c in chunk.get("choices", [])):
            tokens += 1
            if first is None:
                first = time.perf_counter() - start
    c.close()
    return tokens, first


def load(port, clients, seconds, model_name):
    """N clients for `seconds`: aggregate tokens/s, requests, TTFT samples."""
    stop = time.perf_counter() + seconds
    totals, ttfts, errors, done = [0] * clients, [], [], [0]
    lock = threading.Lock()

    def client(i):
        j = 0
        while time.perf_counter() < stop:
            prompt = (f"Client {i}, request {j}. Write a few sentences about "
                      f"{TOPICS[(i + j) % len(TOPICS)]} in the style of letter {i * 31 + j}:")
            try:
                n, first = one_request(port, prompt, model_name)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))
                return
            with lock:
                totals[i] += n
                done[0] += 1
                if first is not None:
                    ttfts.append(first)
            j += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} client errors, first: {errors[0]}")
    return sum(totals) / wall, done[0], ttfts


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    model = pathlib.Path(a.model) if a.model else default_model()
    bin_dir = fixtures.ensure_llama_cpp("avx2", ("llama-server",))
    name = model.stem
    print(f"model {model.name}, {a.threads} threads, {MAX_TOKENS} tokens a request (greedy, "
          f"EOS ignored), {a.seconds:.0f} s per run; llama-server {fixtures.LLAMA_CPP_PYTHON} "
          f"sdist AVX2 build, -np N")
    print("| clients | server | tokens/s | requests | TTFT p50 s | TTFT p99 s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        for n in [int(x) for x in a.clients.split(",")]:
            rates = {}
            for who in ("U", "llama-server"):
                proc, port = (start_u(folder, model, n) if who == "U"
                              else start_llama(bin_dir, model, n, a.threads))
                try:
                    wait_ready(port, proc)
                    one_request(port, "Warm up:", name)
                    rate, requests, ttfts = load(port, n, a.seconds, name)
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
                rates[who] = rate
                print(f"| {n} | {who} | {rate:.1f} | {requests} | {pct(ttfts, 50):.3f} | "
                      f"{pct(ttfts, 99):.3f} |", flush=True)
            ratios.append((n, rates["U"] / rates["llama-server"]))
    print()
    for n, r in ratios:
        print(f"{n} clients: U / llama-server aggregate tokens/s = {r:.2f}")


if __name__ == "__main__":
    sys.exit(main())
