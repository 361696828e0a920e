#!/usr/bin/env python3
"""Speech recognition speed: `u-runner transcribe` beside CTranslate2 (faster-whisper's engine)
on the same Whisper tiny.en weights, audio and threads, in one run.

Two workloads, both greedy:
- the ten espeak-ng sentences of `tests/fixtures/speech/` (2.5–3.7 s each), one window each
  without timestamps — CTranslate2's `Whisper.generate` from `[sot, notimestamps]`;
- the 69 s recording `long.flac` with timestamps: U runs openai-whisper's whole loop (three
  windows, each prompted with the text before it); CTranslate2 decodes the same three windows
  (the seeks U chose) with the same prompts, which is the work faster-whisper's loop gives it.

Both sides are timed from decoded samples to tokens: U's own `timings.seconds` (spectrogram,
encoder, decoder; the model loaded before the clock starts), CTranslate2's spectrogram
(openai-whisper's, in PyTorch) plus `generate`. The real-time factor is seconds per second
of audio; the ratio is CTranslate2's time over U's (above 1: U is faster). Ratios, not
absolute times, are what to quote: machines here are shared.

    python3 tests/bench/transcribe_vs_ctranslate2.py [MODEL_DIR] [--threads 2] [--runs 3]

MODEL_DIR defaults to the CTranslate2 folder `cargo xtask fetch-model whisper-tiny-en` caches;
needs `cargo xtask build` first, and ctranslate2, openai-whisper, soundfile (pip).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import time

import ctranslate2
import numpy as np
import soundfile as sf
import torch
import whisper

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEECH = ROOT / "tests/fixtures/speech"
SOT, NO_TIMESTAMPS, SOT_PREV, TIMESTAMP_BEGIN = 50257, 50362, 50360, 50363


def default_model():
    cache = os.environ.get("U_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "u/models"
    )
    return os.environ.get("U_WHISPER_TINY_EN_DIR") or os.path.join(cache, "whisper-tiny.en-ct2")


def u_transcribe(model, path, threads, extra):
    out = subprocess.run(
        [str(ROOT / "target/release/u-runner"), "transcribe", str(path), "--model", model,
         "--threads", str(threads), "--deployment", str(ROOT / "manifests/dev.toml"),
         "--json", *extra],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout)


def window(audio, seek):
    """openai-whisper's window at `seek`: the content frames from there, zero-padded."""
    full = whisper.log_mel_spectrogram(torch.from_numpy(audio), 80, padding=whisper.audio.N_SAMPLES)
    content = full.shape[-1] - whisper.audio.N_FRAMES
    size = min(whisper.audio.N_FRAMES, content - seek)
    return whisper.pad_or_trim(full[:, seek:seek + size], whisper.audio.N_FRAMES)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=default_model())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ct2 = ctranslate2.models.Whisper(args.model, device="cpu", compute_type="float32",
                                     intra_threads=args.threads)
    clips = sorted(SPEECH.glob("clip_*.wav"))
    long_path = SPEECH / "long.flac"
    audio = {p: sf.read(p, dtype="float32")[0] for p in clips + [long_path]}

    def ct2_clips():
        for p in clips:
            mel = window(audio[p], 0)
            ct2.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(mel[None].numpy())), [[SOT, NO_TIMESTAMPS]],
                         beam_size=1, suppress_blank=True, suppress_tokens=[-1], max_length=448)

    # U's long-file windows, to give CTranslate2 the same seeks and prompts.
    long_u = u_transcribe(args.model, long_path, args.threads, [])
    seeks = sorted({s["seek"] for s in long_u["segments"]})
    prompts, previous = [], []
    for seek in seeks:
        prompts.append(([SOT_PREV] + previous[-223:] if previous else []) + [SOT])
        previous += [t for s in long_u["segments"] if s["seek"] == seek for t in s["tokens"]]

    def ct2_long():
        for seek, prompt in zip(seeks, prompts):
            mel = window(audio[long_path], seek)
            ct2.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(mel[None].numpy())), [prompt],
                         beam_size=1, suppress_blank=True, suppress_tokens=[-1], max_length=448)

    def timed(f):
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    def u_clips():
        return sum(u_transcribe(args.model, p, args.threads, ["--no-timestamps"])["timings"]["seconds"]
                   for p in clips)

    clip_seconds = sum(len(audio[p]) / 16000 for p in clips)
    long_seconds = len(audio[long_path]) / 16000
    rows = []
    for name, u_run, c_run, seconds in [
        (f"10 sentences ({clip_seconds:.1f} s)", u_clips, lambda: timed(ct2_clips), clip_seconds),
        (f"69 s, timestamps ({len(seeks)} windows)",
         lambda: u_transcribe(args.model, long_path, args.threads, [])["timings"]["seconds"],
         lambda: timed(ct2_long), long_seconds),
    ]:
        u_times = [u_run() for _ in range(args.runs)]
        c_times = [c_run() for _ in range(args.runs)]
        u, c = statistics.median(u_times), statistics.median(c_times)
        rows.append((name, u / seconds, c / seconds, c / u))
    print(f"Whisper tiny.en (CTranslate2 fp16 weights, both in f32), {args.threads} threads, "
          f"median of {args.runs} runs")
    print(f"{'workload':34} {'U RTF':>8} {'CT2 RTF':>8} {'CT2/U':>7}")
    for name, u, c, ratio in rows:
        print(f"{name:34} {u:8.3f} {c:8.3f} {ratio:7.2f}")


if __name__ == "__main__":
    main()
