#!/usr/bin/env python3
"""Asynchronous checkpoints: how long a save blocks training, against the
synchronous save, and how fast the background writer goes against `dd`.

Model: GPT-2 small's shape (12 x 768, vocab 50304: 124M parameters) on the tiny-GPT
test config (tests/integration/configs/tiny_gpt.yaml, 16-token sequences, micro
batch 4), fp32 with AdamW: a 1.5 GB checkpoint (weights + two moments), on CPU.

Measured in one run on the same filesystem (--dir), each mode one nnstrain process:
- `checkpoint.async_save: false` then `true`, saving every --every steps;
- blocked by a save = the step time of the step after a save (the trainer saves
  after logging step s, so step s+1 carries it) - the median step time of steps
  with no save in their interval. Asynchronous, the save step returns at once:
  a background thread copies the state into host buffers while step s+1 runs its
  forward and backward, and step s+1 waits for that copy only before its
  optimizer step; so the figure is what the copy costs the step. Also the mean
  step time while the background write runs (the next --every - 1 steps), which
  shows what the writer takes from training on a 2-core machine;
- save throughput: the bytes this rank wrote / its write+fsync time (the
  trainer's "saved checkpoint" line), against `dd bs=4M conv=fsync` of the same
  size from a page-cached file of random data (bench_checkpoint.dd_write), --repeats
  times after each training run so both see the same cache state; best of all.

Writes bench/results/async_save_<UTC time>.json and .md with device, date, torch and
LibTorch versions, commit and load averages.

Usage (from the repository root):
  /root/.cache/nnstrain/venv/bin/python bench/bench_async_save.py --nnstrain build/nnstrain
"""
import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "integration" / "configs" / "tiny_gpt.yaml"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_checkpoint import MIB, clean_env, dd_write, folder_bytes  # noqa: E402
from bench_dp_cpu import cpu_model, git_commit, libtorch_version  # noqa: E402

SAVED = re.compile(r"saved checkpoint \S*step-(\d+) in ([0-9.]+) s \(this rank wrote ([0-9.]+) MiB in ([0-9.]+) s\)")


def train(binary, run_dir, tokens, a, async_save):
    cmd = [binary, "--config", str(CONFIG), "--run_dir", str(run_dir), "--vars.data", str(tokens),
           "--checkpoint.save_dir", str(run_dir / "ckpt"), "--checkpoint.async_save", str(async_save).lower(),
           "--checkpoint.every_n_train_steps", str(a.every), "--checkpoint.keep_last_n_checkpoints", "1",
           "--checkpoint.save_on_end", "false", "--max_train_steps", str(a.steps), "--val_every_n_train_steps", "0",
           "--model.args.n_layer", str(a.n_layer), "--model.args.n_embd", str(a.n_embd),
           "--model.args.n_head", str(a.n_head), "--model.args.vocab_size", str(a.vocab),
           "--optimizer.args.impl", "foreach"]
    load = os.getloadavg()[0]
    p = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"nnstrain failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}{p.stderr}")
    out = p.stdout + p.stderr
    saves = [{"step": int(m[1]), "total_s": float(m[2]), "MiB": float(m[3]), "write_s": float(m[4])}
             for m in SAVED.finditer(out)]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ms = {r["step"]: r["ms_per_step"] for r in records if "ms_per_step" in r}
    saved_steps = {s["step"] for s in saves}
    # Asynchronous: steps that may run beside a background write are not "without save".
    writing = {s + k for s in saved_steps for k in range(2, a.every + 1)} if async_save else set()
    plain = [v for s, v in ms.items() if s - 1 not in saved_steps and s not in writing and s > 2]
    base = statistics.median(plain)
    blocked = [ms[s + 1] - base for s in sorted(saved_steps) if s + 1 in ms]
    during = [ms[s] for s in sorted(writing) if s in ms]
    ckpt = sorted((run_dir / "ckpt").glob("step-*"))[-1]
    return {"async_save": async_save, "checkpoint_bytes": folder_bytes(ckpt), "saves": saves,
            "step_ms_median_without_save": base, "step_ms": ms, "blocked_ms": blocked,
            "blocked_ms_median": statistics.median(blocked),
            "step_ms_mean_during_background_write": statistics.mean(during) if during else None,
            "write_MBps": [s["MiB"] * MIB / s["write_s"] / 1e6 for s in saves],
            "load_avg_1min": [round(load, 2), round(os.getloadavg()[0], 2)]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"), help="the nnstrain binary")
    ap.add_argument("--dir", default=None, help="where checkpoints and dd write (default: a temporary folder)")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--steps", type=int, default=26, help="training steps per run")
    ap.add_argument("--every", type=int, default=6, help="checkpoint.every_n_train_steps")
    ap.add_argument("--repeats", type=int, default=3, help="dd repetitions (best kept)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    binary = str(pathlib.Path(a.nnstrain).resolve())

    load_start = round(os.getloadavg()[0], 2)
    work = pathlib.Path(tempfile.mkdtemp(prefix="nnstrain_bench_async_", dir=a.dir))
    try:
        tokens = work / "tokens.bin"
        np.random.default_rng(0).integers(0, a.vocab, 200_000).astype("<u2").tofile(tokens)
        fs = subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout.splitlines()[-1].split()
        runs, dd = [], []
        for async_save in (False, True):
            runs.append(train(binary, work / ("async" if async_save else "sync"), tokens, a, async_save))
            nbytes = runs[0]["checkpoint_bytes"]
            for _ in range(a.repeats):  # interleaved with the runs: the same cache state
                n, dt = dd_write(work, nbytes)
                dd.append({"MBps": n / dt / 1e6, "after": "async" if async_save else "sync",
                           "load_avg_1min": round(os.getloadavg()[0], 2)})
        shutil.rmtree(work / "sync", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    dd_best = max(d["MBps"] for d in dd)
    dd_median = statistics.median(d["MBps"] for d in dd)
    sync, asyn = runs
    params = (sync["checkpoint_bytes"] / 12) / 1e6  # fp32 weights + 2 moments, to within the RNG state

    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "async_save", "date": now.isoformat(timespec="seconds"),
              "device": f"{cpu_model()} ({os.cpu_count()} logical CPUs), filesystem {fs[1]} on {fs[0]}",
              "torch": torch.__version__, "libtorch": libtorch_version(binary), "commit": git_commit(),
              "load_avg_1min_start": load_start,
              "model": {"n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": a.n_head, "vocab": a.vocab,
                        "parameters_M": round(params, 1)},
              "steps": a.steps, "every": a.every, "dd": dd, "dd_MBps_best": dd_best, "dd_MBps_median": dd_median,
              "runs": runs}
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"async_save_{now.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")

    def row(r):
        w = r["write_MBps"]
        during = r["step_ms_mean_during_background_write"]
        return (f"| {'async' if r['async_save'] else 'sync'} | {r['checkpoint_bytes'] / MIB:.0f} MiB | "
                f"{r['step_ms_median_without_save']:.0f} ms | "
                f"{', '.join(f'{b:.0f}' for b in r['blocked_ms'])} ms (median {r['blocked_ms_median']:.0f}) | "
                f"{(f'{during:.0f} ms' if during and r['async_save'] else '-')} | "
                f"{statistics.median(w):.0f} MB/s ({100 * statistics.median(w) / dd_best:.0f}% of dd's best, "
                f"{100 * statistics.median(w) / dd_median:.0f}% of its median) | "
                f"{max(w):.0f} MB/s ({100 * max(w) / dd_best:.0f}% of dd's best) | "
                f"{r['load_avg_1min']} |")
    ratio = asyn["blocked_ms_median"] / sync["blocked_ms_median"]
    dd_runs = ", ".join(f"{d['MBps']:.0f} after {d['after']} (load {d['load_avg_1min']})" for d in dd)
    lines = [f"# Asynchronous checkpoints ({now.strftime('%Y-%m-%d %H:%M')} UTC)", "",
             f"- device: {record['device']}",
             f"- torch {record['torch']}, LibTorch (nnstrain) {record['libtorch']}, commit {record['commit']}",
             f"- model: GPT {a.n_layer} x {a.n_embd}, vocab {a.vocab}: {params:.0f}M parameters, fp32, AdamW "
             f"(foreach); {a.steps} steps, a save every {a.every}; one process, OMP_NUM_THREADS=1",
             f"- baseline: `dd bs=4M conv=fsync` of {nbytes / MIB:.0f} MiB from a page-cached file of random data "
             f"on the same filesystem, {a.repeats} after each run: best {dd_best:.0f} MB/s (runs: "
             f"{dd_runs})", "",
             "| save | checkpoint | step without save | blocked per save | step during background write | "
             "write+fsync speed (median) | best save | load avg |",
             "|---|---:|---:|---|---:|---:|---:|---|",
             row(sync), row(asyn), "",
             f"Blocked time, asynchronous / synchronous (medians): {100 * ratio:.1f}%. Blocked = step time of the "
             "step after a save - median step time of steps with no save in their interval; asynchronous, it is "
             "what the copy of the state into host buffers (reused from one save to the next, overlapping the next "
             "forward and backward) costs that step. The write speed is the rank's bytes over its write+fsync time "
             "(the whole save for sync; the background thread's write for async, without the publish). dd's best "
             "is one run out of all; set against the median of the saves it is the harsher ratio, so the median "
             "against dd's median and the best save against dd's best are given too."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
