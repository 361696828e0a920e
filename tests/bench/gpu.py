#!/usr/bin/env python3
"""U's GPU plugin (kernels-wgpu) on a real GPU: pp and tg tokens/s, the decode's fraction of
the device's memory bandwidth, and llama.cpp's Vulkan build beside it where one is available.

    python3 tests/bench/gpu.py                                   # SmolLM2, the default adapter
    python3 tests/bench/gpu.py --model m.gguf --adapter "RTX 4090" --bandwidth-gbs 1008
    python3 tests/bench/gpu.py --llama-vulkan                    # and llama.cpp on Vulkan

U runs `u-runner bench --json` on a copy of manifests/gpu.toml (beside it, so its relative
paths hold) whose kernels-wgpu opens the adapter named by `--adapter` (part of its name; the
default is wgpu's high-performance adapter) and whose model runs on the GPU plugin alone
(`[model] kernels = ["kernels-wgpu"]`, so nothing silently runs on the CPU). The device's name
comes from `u-runner plugins --json`.

The bandwidth fraction is (decode tokens/s × bytes of weights read per token) ÷ the device's
memory bandwidth: `--bandwidth-gbs`, else the datasheet figure of a few known GPUs matched by
name (H100 SXM 3350, H200 4800, A100 80GB 2039, L40S 864, RTX 4090 1008, RTX 3090 936), else,
for a CPU-backed adapter (lavapipe), the host's measured read bandwidth (as
tests/bench/llama_bench.py measures it). Bytes per token count every tensor but the embedding
table (one row of it is read), as llama_bench.py does; KV reads are left out.

`--llama-vulkan` builds llama.cpp 0.3.36's `llama-bench` with `-DGGML_VULKAN=ON` (Debian's
`glslc` and `libvulkan-dev` are installed with apt-get when missing; the shader compile takes a
long while on 2 cores) and runs it with every layer offloaded (`-ngl 99`), printing U ÷ llama.cpp
per test. Quote the ratios and the device's name, not absolute times: machines here are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))
import gen_bench_llama as fixtures  # noqa: E402
import llama_bench  # noqa: E402

DATASHEET_GBS = {
    "H100": 3350.0,
    "H200": 4800.0,
    "A100": 2039.0,
    "L40S": 864.0,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_model() -> Path:
    out = subprocess.run(["cargo", "xtask", "fetch-model"], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def gpu_deployment(adapter: str | None) -> Path:
    """manifests/gpu.toml with kernels-wgpu alone computing, on `adapter` when named."""
    text = (ROOT / "manifests" / "gpu.toml").read_text()
    grant = "[plugins.grants]\ngpu = true\n"
    assert grant in text, "manifests/gpu.toml grants kernels-wgpu the gpu"
    if adapter:
        text = text.replace(grant, grant + f"[plugins.config]\nadapter = {json.dumps(adapter)}\n")
    text = text.replace('kernels = ["kernels-wgpu", "kernels-cpu"]', 'kernels = ["kernels-wgpu"]')
    fd, name = tempfile.mkstemp(prefix=".gpu-bench-", suffix=".toml", dir=ROOT / "manifests")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(name)


def device_name(runner: Path, deployment: Path) -> str:
    out = subprocess.run([str(runner), "plugins", "--json", str(deployment)], check=True,
                         capture_output=True, text=True)
    for plugin in json.loads(out.stdout)["loaded"]:
        if plugin["name"] == "kernels-wgpu":
            return plugin.get("device") or "(unknown)"
    sys.exit("kernels-wgpu did not load: " + out.stderr[-2000:])


def bandwidth_for(device: str, given: float | None) -> tuple[float, str]:
    if given:
        return given, "given"
    for name, gbs in DATASHEET_GBS.items():
        if name.lower() in device.lower():
            return gbs, f"datasheet ({name})"
    if "llvmpipe" in device.lower() or "swiftshader" in device.lower():
        return llama_bench.read_bandwidth(os.cpu_count() or 1, 1024), "host read (measured)"
    sys.exit(f"no memory bandwidth known for {device!r}: pass --bandwidth-gbs")


def run_u(runner: Path, deployment: Path, model: Path, a) -> dict[str, list[float]]:
    out = subprocess.run(
        [str(runner), "bench", "--deployment", str(deployment), "--model", str(model),
         "-p", str(a.p), "-n", str(a.n), "-d", str(a.depth), "--reps", str(a.reps), "--json"],
        capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("u-runner bench failed: " + out.stderr[-4000:])
    return llama_bench.split(json.loads(out.stdout))


def ensure_vulkan_llama_cpp() -> Path:
    """llama-bench built with the Vulkan backend (cached beside the CPU builds)."""
    if not shutil.which("glslc") or not Path("/usr/include/vulkan/vulkan.h").exists():
        log("installing glslc and libvulkan-dev (apt-get)")
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "glslc",
                        "libvulkan-dev"], check=True)
    cpu_bin = fixtures.ensure_llama_cpp(fixtures.default_isa(), ("llama-bench",))
    src = cpu_bin.parent / "src"
    root = fixtures.cache_root() / "llama.cpp" / f"{fixtures.LLAMA_CPP_PYTHON}-vulkan"
    exe = root / "bin" / "llama-bench"
    if exe.exists():
        return exe
    build = root / "build"
    cmake = fixtures.ensure_cmake()
    subprocess.run(
        [cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
         "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DGGML_VULKAN=ON", "-DGGML_NATIVE=ON"],
        check=True)
    log("building llama-bench with Vulkan (its shaders take a long while to compile)")
    subprocess.run([cmake, "--build", str(build), "-j", str(os.cpu_count() or 2),
                    "--target", "llama-bench"], check=True)
    exe.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / "llama-bench", exe)
    return exe


def run_llama_vulkan(exe: Path, model: Path, a) -> dict[str, list[float]]:
    out = subprocess.run(
        [str(exe), "-m", str(model), "-p", str(a.p), "-n", str(a.n), "-d", str(a.depth),
         "-r", str(a.reps), "-ngl", "99", "-o", "json"],
        check=True, capture_output=True, text=True)
    return llama_bench.split(json.loads(out.stdout))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--adapter", help="part of the GPU adapter's name")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens of the pp test")
    ap.add_argument("-n", type=int, default=128, help="tokens of the tg test")
    ap.add_argument("--depth", type=int, default=0, help="context depth before each test")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bandwidth-gbs", type=float, help="the device's memory bandwidth")
    ap.add_argument("--llama-vulkan", action="store_true",
                    help="also build and run llama.cpp's Vulkan llama-bench")
    a = ap.parse_args()
    model = (a.model or default_model()).resolve()
    runner = llama_bench.ensure_u()
    os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())
    deployment = gpu_deployment(a.adapter)
    try:
        device = device_name(runner, deployment)
        log(f"device: {device}")
        u = run_u(runner, deployment, model, a)
    finally:
        deployment.unlink()
    bandwidth, source = bandwidth_for(device, a.bandwidth_gbs)
    per_token = llama_bench.weight_bytes_per_token(model)
    peer = {}
    if a.llama_vulkan:
        peer = run_llama_vulkan(ensure_vulkan_llama_cpp(), model, a)
    print(f"model: {model.name} ({per_token / 1e6:.1f} MB of weights read per token)")
    print(f"device: {device}; bandwidth {bandwidth:.1f} GB/s ({source})")
    header = f"{'test':<14}{'U t/s':>18}"
    if peer:
        header += f"{'llama.cpp Vulkan t/s':>24}{'U/llama.cpp':>13}"
    print(header + f"{'bandwidth fraction':>20}")
    for test, samples in u.items():
        line = f"{test:<14}{llama_bench.fmt(samples):>18}"
        if peer:
            theirs = peer.get(test, [])
            ratio = (sum(samples) / len(samples)) / (sum(theirs) / len(theirs)) if theirs else 0
            line += f"{llama_bench.fmt(theirs):>24}{ratio:>13.2f}"
        fraction = ""
        if test.startswith("tg"):
            mean = sum(samples) / len(samples)
            fraction = f"{mean * per_token / (bandwidth * 1e9):.1%}"
        print(line + f"{fraction:>20}")


if __name__ == "__main__":
    main()
