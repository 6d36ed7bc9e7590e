#!/usr/bin/env python3
"""Checkpoint I/O: how fast nnstrain saves against what the disk can do, how long a
save blocks training, and what `nnstrain merge` costs in time and memory.

Model: the tiny-GPT test config (tests/integration/configs/tiny_gpt.yaml) widened by
--n-layer / --n-embd / --vocab (default 8 x 512, vocab 4096: 27M parameters, a
~313 MiB checkpoint of weights + two AdamW moments), fp32, on random tokens.

Measured, all in one run on the same filesystem (--dir):
- baseline: the disk's sequential write speed, `dd bs=4M conv=fsync` of as many
  bytes as one checkpoint from a page-cached file of random data (best of --repeats
  after each training run, so both see the same cache state);
- save speed: checkpoint bytes / the save time the trainer logs ("saved checkpoint
  DIR in X s": every rank writes and fsyncs its shard, rank 0 the manifest, the
  rename, the `latest` pointer and pruning), as a fraction of dd's speed;
  for dp=1, and dp=2 sharded and deduped (`nnstrain launch`, 2 processes);
- training blocked by a save: the trainer saves after logging step s, so the step
  after a save carries it; blocked = its step time - the median of steps without a
  save, next to the logged save time;
- merge of the last dp=2 sharded checkpoint: wall time, MB/s, peak RSS (VmHWM via
  wait4 from a small parent process) against the peak of merging a tiny checkpoint
  (the binary's own startup), plain and with --hf.

Writes bench/results/checkpoint_<UTC time>.json and .md with the device, date, torch
and LibTorch versions, git commit and load averages.

Usage (from the repository root):
  /root/.cache/nnstrain/venv/bin/python bench/bench_checkpoint.py --nnstrain build/nnstrain
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
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "integration" / "configs" / "tiny_gpt.yaml"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_dp_cpu import cpu_model, git_commit, libtorch_version  # noqa: E402

PEAK_RSS = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(p.pid, 0)
print(f"MAXRSS_KB {usage.ru_maxrss}", flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""
MIB = 1 << 20


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PBS_", "PALS_", "OMPI_", "PMI_", "PMIX_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def folder_bytes(path):
    return sum(p.stat().st_size for p in pathlib.Path(path).rglob("*") if p.is_file())


def dd_source(folder, nbytes):
    """A file of nbytes random bytes in folder, durable and in the page cache (dd's input)."""
    src = pathlib.Path(folder) / "dd_source.bin"
    if not src.exists() or src.stat().st_size != nbytes:
        with open(src, "wb") as f:
            for off in range(0, nbytes, 64 * MIB):
                f.write(os.urandom(min(64 * MIB, nbytes - off)))
            f.flush()
            os.fsync(f.fileno())
    return src


def dd_write(folder, nbytes):
    """Seconds to write nbytes sequentially and fsync them, as dd does.

    The input is random data already in the page cache, as a checkpoint's tensors are
    in memory: zeros (/dev/zero) can be cheaper for the storage below a VM to take
    (seen: 1900-2074 MB/s from /dev/zero against 900-1600 MB/s from random data on
    the same disk in the same minute), which would flatter the baseline."""
    src = dd_source(folder, nbytes)
    target = pathlib.Path(folder) / "dd.bin"
    with open(src, "rb") as f:  # in the page cache before the clock starts
        while f.read(64 * MIB):
            pass
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={src}", f"of={target}", "bs=4M", "conv=fsync"], check=True, capture_output=True)
    dt = time.perf_counter() - t0
    target.unlink()
    return nbytes, dt


def train(binary, nproc, run_dir, tokens, args, save_type, steps, every):
    cmd = [binary]
    if nproc > 1:
        cmd += ["launch", "--nproc-per-node", str(nproc), "--"]
    cmd += ["--config", str(CONFIG), "--run_dir", str(run_dir), "--vars.data", str(tokens),
            "--checkpoint.save_dir", str(run_dir / "ckpt"), "--checkpoint.save_type", save_type,
            "--checkpoint.every_n_train_steps", str(every), "--checkpoint.keep_last_n_checkpoints", "2",
            "--checkpoint.async_save", "false",  # what this bench times: the whole synchronous save
            "--checkpoint.save_on_end", "false", "--max_train_steps", str(steps), "--val_every_n_train_steps", "0",
            "--model.args.n_layer", str(args.n_layer), "--model.args.n_embd", str(args.n_embd),
            "--model.args.n_head", str(args.n_head), "--model.args.vocab_size", str(args.vocab),
            "--micro_batch_size", str(4 // nproc)]
    load = os.getloadavg()[0]
    p = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"nnstrain failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}{p.stderr}")
    out = p.stdout + p.stderr
    saves = [(int(m.group(1)), float(m.group(2)))
             for m in re.finditer(r"saved checkpoint \S*step-(\d+) in ([0-9.]+) s", out)]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ms = {r["step"]: r["ms_per_step"] for r in records if "ms_per_step" in r}
    last = run_dir / "ckpt" / f"step-{saves[-1][0]:08d}"
    ckpt_bytes = folder_bytes(last)
    after_save = {s + 1 for s, _ in saves}
    plain = [v for s, v in ms.items() if s not in after_save and s > 1]  # step 1 warms up
    base = statistics.median(plain)
    blocked = [ms[s + 1] - base for s, _ in saves if s + 1 in ms]
    save_s = [t for _, t in saves]
    return {"nproc": nproc, "save_type": save_type, "checkpoint_bytes": ckpt_bytes,
            "checkpoint_files": sorted(p.name for p in last.iterdir()),
            "save_s": save_s, "save_s_median": statistics.median(save_s),
            "save_MBps": ckpt_bytes / statistics.median(save_s) / 1e6,
            "step_ms_median_without_save": base, "blocked_ms": blocked,
            "blocked_ms_median": statistics.median(blocked) if blocked else None,
            "load_avg_1min": [round(load, 2), round(os.getloadavg()[0], 2)], "last_checkpoint": str(last)}


def merge(binary, src, out, hf=False):
    cmd = [sys.executable, "-c", PEAK_RSS, binary, "merge", str(src), "--out", str(out)] + (["--hf"] if hf else [])
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"merge failed: {p.stdout}{p.stderr}")
    rss = int(re.search(r"MAXRSS_KB (\d+)", p.stdout).group(1)) * 1024
    return dt, rss


def largest_tensor_bytes(ckpt):
    m = json.loads((pathlib.Path(ckpt) / "manifest.json").read_text())
    return max(int(np.prod(e["global_shape"], dtype=np.int64)) * 4
               for es in m["files"].values() for e in es if e["dtype"] == "F32")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"), help="the nnstrain binary")
    ap.add_argument("--dir", default=None, help="where checkpoints and dd write (default: a temporary folder)")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16, help="training steps per run")
    ap.add_argument("--every", type=int, default=4, help="checkpoint.every_n_train_steps")
    ap.add_argument("--repeats", type=int, default=3, help="dd repetitions after each run (best of all kept)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    binary = str(pathlib.Path(a.nnstrain).resolve())

    load_start = round(os.getloadavg()[0], 2)
    work = pathlib.Path(tempfile.mkdtemp(prefix="nnstrain_bench_ckpt_", dir=a.dir))
    try:
        tokens = work / "tokens.bin"
        np.random.default_rng(0).integers(0, a.vocab, 200_000).astype("<u2").tofile(tokens)
        fs = subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout.splitlines()[-1].split()

        runs, dd = [], []
        for nproc, name, save_type in [(1, "dp1", "sharded"), (2, "dp2_sharded", "sharded"),
                                       (2, "dp2_deduped", "deduped")]:
            runs.append(train(binary, nproc, work / name, tokens, a, save_type, a.steps, a.every))
            nbytes = runs[0]["checkpoint_bytes"]
            for _ in range(a.repeats):  # interleaved with the runs: the same cache state
                n, dt = dd_write(work, nbytes)
                dd.append(n / dt / 1e6)
        (work / "dd_source.bin").unlink()
        dd_best = max(dd)
        for r in runs:
            r["fraction_of_dd"] = r["save_MBps"] / dd_best

        src = runs[1]["last_checkpoint"]
        tiny = work / "tiny"
        subprocess.run([binary, "--config", str(CONFIG), "--run_dir", str(tiny), "--vars.data", str(tokens),
                        "--checkpoint.save_dir", str(tiny / "ckpt"), "--max_train_steps", "1",
                        "--model.args.vocab_size", str(a.vocab)], cwd=ROOT, env=clean_env(), check=True,
                       capture_output=True)
        _, base_rss = merge(binary, tiny / "ckpt" / "step-00000001", work / "tiny_merged")
        merge_s, merge_rss = merge(binary, src, work / "merged")
        merge_hf_s, merge_hf_rss = merge(binary, src, work / "merged_hf", hf=True)
        merged_bytes = folder_bytes(work / "merged")
        merge_rec = {"source": "dp2_sharded", "source_bytes": runs[1]["checkpoint_bytes"],
                     "merged_bytes": merged_bytes, "largest_tensor_bytes": largest_tensor_bytes(src),
                     "seconds": merge_s, "MBps_written": merged_bytes / merge_s / 1e6,
                     "peak_rss_bytes": merge_rss, "peak_rss_tiny_checkpoint_bytes": base_rss,
                     "hf_seconds": merge_hf_s, "hf_peak_rss_bytes": merge_hf_rss}
        params = sum(int(np.prod(e["global_shape"])) for es in json.loads(
            (pathlib.Path(runs[0]["last_checkpoint"]) / "manifest.json").read_text())["files"].values()
            for e in es if e["name"].startswith("model/"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "checkpoint", "date": now.isoformat(timespec="seconds"),
        "device": f"{cpu_model()} ({os.cpu_count()} logical CPUs), filesystem {fs[1]} on {fs[0]}",
        "torch": torch.__version__, "libtorch": libtorch_version(binary), "commit": git_commit(),
        "binary": binary, "load_avg_1min_start": load_start,
        "model": {"n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": a.n_head, "vocab": a.vocab,
                  "parameters": params},
        "dd_MBps": dd, "dd_MBps_best": dd_best, "runs": runs, "merge": merge_rec,
    }
    for r in runs:
        r.pop("last_checkpoint")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"checkpoint_{now.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")

    lines = [f"# Checkpoint I/O ({now.strftime('%Y-%m-%d %H:%M')} UTC)", "",
             f"- device: {record['device']}",
             f"- torch {record['torch']}, LibTorch (nnstrain) {record['libtorch']}, commit {record['commit']}",
             f"- model: GPT {a.n_layer} x {a.n_embd}, vocab {a.vocab}: {params / 1e6:.1f}M parameters, fp32; "
             f"a checkpoint holds weights + AdamW's two moments + RNG state",
             f"- baseline: `dd bs=4M conv=fsync` of {nbytes / MIB:.0f} MiB from a page-cached file of random data "
             f"on the same filesystem, {a.repeats} after each run: "
             f"best {dd_best:.0f} MB/s (runs: {', '.join(f'{x:.0f}' for x in dd)})", "",
             "| run | checkpoint | save time (median) | save MB/s | of dd | step without save | blocked by a save (median) | load avg |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        lines.append(f"| dp={r['nproc']} {r['save_type']} | {r['checkpoint_bytes'] / MIB:.0f} MiB | "
                     f"{r['save_s_median']:.2f} s | {r['save_MBps']:.0f} | {100 * r['fraction_of_dd']:.0f}% | "
                     f"{r['step_ms_median_without_save']:.0f} ms | {r['blocked_ms_median']:.0f} ms | "
                     f"{r['load_avg_1min']} |")
    mr = merge_rec
    lines += ["",
              "Save time is the trainer's own log line (all ranks write and fsync, then the manifest, rename, "
              "`latest`, pruning). Blocked = step time of the step after a save - median step time without one; "
              "saves are synchronous, so it tracks the save time.", "",
              f"Merge of the dp=2 sharded checkpoint ({mr['source_bytes'] / MIB:.0f} MiB, largest tensor "
              f"{mr['largest_tensor_bytes'] / MIB:.1f} MiB) into {mr['merged_bytes'] / MIB:.0f} MiB: "
              f"{mr['seconds']:.2f} s ({mr['MBps_written']:.0f} MB/s written incl. fsync, process start included); "
              f"peak RSS {mr['peak_rss_bytes'] / MIB:.0f} MiB vs {mr['peak_rss_tiny_checkpoint_bytes'] / MIB:.0f} MiB "
              f"for merging a tiny checkpoint (the binary's startup), +{(mr['peak_rss_bytes'] - mr['peak_rss_tiny_checkpoint_bytes']) / MIB:.0f} MiB; "
              f"with --hf {mr['hf_seconds']:.2f} s, peak {mr['hf_peak_rss_bytes'] / MIB:.0f} MiB "
              f"(+{(mr['hf_peak_rss_bytes'] - mr['peak_rss_tiny_checkpoint_bytes']) / MIB:.0f} MiB: it builds the model once "
              f"to learn its Hugging Face names, {4 * params / MIB:.0f} MiB of weights, partly hidden under the "
              "startup peak)."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
