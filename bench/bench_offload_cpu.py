#!/usr/bin/env python3
"""Optimizer (and parameter) offload on CPU: what each rank holds on its
"device" and on the host between steps, the step's peak device tensor bytes
against the planner's estimate, and tokens/s, with and without offload.

On a machine without a GPU offload runs its own code path with ordinary host
buffers counted apart from the device's tensors (trainer/offload/offload.h),
so the memory figures are exact and the throughput shows the cost of the
extra copies and the bucket-by-bucket host step in CPU terms only: the device
is the CPU too, so there is no PCIe link to hide and no GPU step to overlap
with (the GPU figures: bench/gpu, phase `offload`).

Setups (GPT, 4 layers, n_embd 256, fp32 and bf16-mixed, synthetic tokens):
one rank (no ZeRO) with and without optimizer offload, and dp 2 ZeRO-2 with
and without it, and dp 2 ZeRO-3 with parameter offload. Each pair runs in
interleaved rounds (`--rounds`), so a change of the machine's load hits both;
tokens/s is the median over rounds of each run's median over its logged steps
after the first. Results: bench/results/offload_cpu_<stamp>.{json,md}.
"""
import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from bench_common import ROOT, cpu_model, git_commit, libtorch_version

BIN = pathlib.Path(os.environ.get("NNSTRAIN_BIN", ROOT / "build" / "nnstrain"))
LAYERS, EMBD, SEQ = 4, 256, 128
CONFIG = """
model: {{type: gpt, args: {{vocab_size: 256, block_size: {seq}, n_layer: {layers}, n_head: 4, n_embd: {embd}, dropout: 0.0, bias: true}}}}
optimizer: {{type: adamw, args: {{lr: 1.0e-3}}, clip_gnorm: 1.0}}
dataset: {{type: token_bin, train_args: {{path: {data}, dtype: uint16, seq_len: {seq}}}}}
compute_config: {{device: cpu, backend: gloo}}
pas_policy: dp
micro_batch_size: 8
log_progress_every_n_train_steps: 1
seed: 1
"""
OFF = ["--compute_config.offload.optimizer", "true"]
# (label, processes, overrides)
SETUPS = [
    ("1 rank", 1, []),
    ("1 rank, optimizer offload", 1, OFF),
    ("dp2 ZeRO-2", 2, ["--compute_config.use_zero", "2"]),
    ("dp2 ZeRO-2, optimizer offload", 2, ["--compute_config.use_zero", "2", *OFF]),
    ("dp2 ZeRO-3", 2, ["--compute_config.use_zero", "3"]),
    ("dp2 ZeRO-3, optimizer + params offload", 2, ["--compute_config.use_zero", "3", *OFF,
                                                   "--compute_config.offload.params", "true"]),
]


def held(log):
    m = re.search(r"held between steps: parameters (\d+), gradients (\d+), masters (\d+), optimizer moments (\d+)", log)
    h = re.search(r"held on the host between steps \(offload\): weights (\d+), gradients (\d+), optimizer moments "
                  r"(\d+), parameters and staging (\d+)", log)
    return sum(map(int, m.groups())), sum(map(int, h.groups())) if h else 0


def run(cfg, nproc, extra, precision, steps, tmp, tag, threads):
    run_dir = tmp / tag
    args = ["--config", str(cfg), "--run_dir", str(run_dir), "--max_train_steps", str(steps), "--precision",
            precision, *extra]
    cmd = [str(BIN), *args] if nproc == 1 else [str(BIN), "launch", "--nproc-per-node", str(nproc), "--", *args]
    p = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{tag} failed: {p.stdout}{p.stderr}")
    recs = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if '"loss"' in l]
    plan = json.loads((run_dir / "plan.json").read_text())
    dev, host = held((run_dir / "logs" / "rank0.log").read_text())
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs[1:]),
            "peak_tensor_mb": max(r["peak_tensor_mb"] for r in recs),
            "estimate_mb": plan["estimate"]["total_bytes"] / 2**20,
            "estimate_host_mb": plan["estimate"].get("host_bytes", 0) / 2**20,
            "held_device_mb": dev / 2**20, "held_host_mb": host / 2**20,
            "optimizer_ms": statistics.median(r.get("time_optimizer_ms", 0) for r in recs[1:]),
            "losses": [r["loss"] for r in recs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--precisions", default="32-true,bf16-mixed")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = pathlib.Path(t)
        data = tmp / "tokens.bin"
        np.random.default_rng(0).integers(0, 256, size=400_000, dtype=np.uint16).tofile(data)
        cfg = tmp / "gpt.yaml"
        cfg.write_text(CONFIG.format(seq=SEQ, layers=LAYERS, embd=EMBD, data=data))
        for precision in a.precisions.split(","):
            results = {label: [] for label, _, _ in SETUPS}
            for r in range(a.rounds):
                for label, nproc, extra in SETUPS:
                    res = run(cfg, nproc, extra, precision, a.steps, tmp, f"{len(rows)}_{r}_{label.replace(' ', '_')}",
                              a.threads)
                    results[label].append(res)
                    print(f"{precision} round {r} {label}: {res['tokens_per_s']:.0f} tok/s, device held "
                          f"{res['held_device_mb']:.2f} MiB, host {res['held_host_mb']:.2f} MiB, peak "
                          f"{res['peak_tensor_mb']:.2f} MiB (estimate {res['estimate_mb']:.2f})", flush=True)
            for i, (label, nproc, extra) in enumerate(SETUPS):
                runs = results[label]
                base = results[SETUPS[i - 1][0]] if "offload" in label else runs
                tps = statistics.median(x["tokens_per_s"] for x in runs)
                base_tps = statistics.median(x["tokens_per_s"] for x in base)
                first = runs[0]
                rows.append({"precision": precision, "setup": label, "tokens_per_s": tps,
                             "vs_no_offload": tps / base_tps, "held_device_mb": first["held_device_mb"],
                             "held_host_mb": first["held_host_mb"], "peak_tensor_mb": first["peak_tensor_mb"],
                             "estimate_mb": first["estimate_mb"], "estimate_host_mb": first["estimate_host_mb"],
                             "estimate_error": first["estimate_mb"] / first["peak_tensor_mb"] - 1,
                             "optimizer_ms": statistics.median(x["optimizer_ms"] for x in runs),
                             "same_losses_as_no_offload": first["losses"] == base[0]["losses"],
                             "runs_tokens_per_s": [x["tokens_per_s"] for x in runs]})
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": cpu_model(),
            "libtorch": libtorch_version(BIN), "commit": git_commit(), "load_average": os.getloadavg(),
            "model": f"GPT {LAYERS} layers, n_embd {EMBD}, vocab 256, micro-batch 8 x {SEQ} tokens per rank",
            "steps": a.steps, "rounds": a.rounds, "threads_per_rank": a.threads}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ROOT / "bench" / "results" / f"offload_cpu_{stamp}"
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Offload on CPU (host buffers counted apart from the device's tensors)", "", f"{meta}", "",
             "| precision | setup | tokens/s | vs without offload | device held between steps MiB | host held MiB | "
             "peak device tensors MiB | plan estimate MiB (error) | plan host MiB | optimizer ms | losses equal |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['setup']} | {r['tokens_per_s']:.0f} | {r['vs_no_offload']:.2f} | "
                     f"{r['held_device_mb']:.2f} | {r['held_host_mb']:.2f} | {r['peak_tensor_mb']:.2f} | "
                     f"{r['estimate_mb']:.2f} ({100 * r['estimate_error']:+.1f}%) | {r['estimate_host_mb']:.2f} | "
                     f"{r['optimizer_ms']:.1f} | {'yes' if r['same_losses_as_no_offload'] else 'no'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {out}.md")


if __name__ == "__main__":
    main()
