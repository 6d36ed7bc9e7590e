#!/usr/bin/env python3
"""Host memory at start-up per rank, by tensor-parallel degree (and under ZeRO-3).

A GPT of about 1 GB of fp32 weights (16 layers x 1024, 16 heads, vocab 50304:
253M parameters) is started at tp = 1, 2, 4 (one process per rank, CPU, Gloo)
for one training step of one 16-token sequence. Each rank logs
`rank R: start-up peak host RSS X MiB` (its VmHWM once the model is built and
split, the training state allocated and any checkpoint loaded, before the first
step); this script reads those lines from the ranks' log files and reports the
largest per degree, with the ratio to tp=1 measured in the same run. A plan
`zero3dpN` runs N data-parallel ranks under ZeRO-3 instead (each materialises
one parameter at a time into its chunks).

Writes bench/results/startup_rss_<UTC time>.json and .md with device, date, torch
and LibTorch versions, commit and load averages.

Usage (from the repository root):
  /root/.cache/nnstrain/venv/bin/python bench/bench_startup_rss.py --nnstrain build/nnstrain [--label before]
"""
import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import cpu_model, git_commit, libtorch_version  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "integration" / "configs" / "tiny_gpt.yaml"
RSS = re.compile(r"rank (\d+): start-up peak host RSS ([0-9.]+) MiB")


def run(binary, plan, data, work, n_layer, n_embd, n_head, vocab):
    run_dir = work / plan
    zero3 = plan.startswith("zero3dp")
    tp = int(plan[len("zero3dp"):] if zero3 else plan[2:])  # ranks
    args = ["--config", str(CONFIG), "--run_dir", str(run_dir), "--vars.data", str(data),
            "--model.args.n_layer", str(n_layer), "--model.args.n_embd", str(n_embd),
            "--model.args.n_head", str(n_head), "--model.args.vocab_size", str(vocab),
            "--micro_batch_size", "1", "--max_train_steps", "1", "--val_every_n_train_steps", "0",
            "--checkpoint.save_dir", "", "--compute_config.device", "cpu"]
    if zero3:
        args += ["--compute_config.use_zero", "3", "--pas_policy", "dp"]
    elif tp > 1:
        args += ["--compute_config.plan_ngpus", str(tp), "--pas_policy", "tp"]
    cmd = [binary, *args] if tp == 1 else [binary, "launch", "--nproc-per-node", str(tp), "--", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    per_rank = {}
    for log in sorted((run_dir / "logs").glob("*")):
        for m in RSS.finditer(log.read_text()):
            per_rank[int(m.group(1))] = float(m.group(2))
    if sorted(per_rank) != list(range(tp)):
        sys.exit(f"{plan}: expected a start-up RSS line from ranks 0..{tp - 1}, found {sorted(per_rank)}")
    return per_rank


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"))
    ap.add_argument("--label", default="", help="what this measures (e.g. 'before meta init')")
    ap.add_argument("--plans", default="tp1,tp2,tp4", help="tpN (tensor parallel) or zero3dpN, the first the baseline")
    ap.add_argument("--n-layer", type=int, default=16)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    nparams = a.n_layer * (12 * a.n_embd**2 + 13 * a.n_embd) + (a.vocab + 16) * a.n_embd + 2 * a.n_embd
    degrees = a.plans.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        data = work / "tokens.bin"
        np.random.default_rng(0).integers(0, a.vocab, 4096, dtype=np.uint16).tofile(data)
        load = [os.getloadavg()[0]]
        results = {}
        for tp in degrees:
            results[tp] = run(a.nnstrain, tp, data, work, a.n_layer, a.n_embd, a.n_head, a.vocab)
            load.append(os.getloadavg()[0])
    base = max(results[degrees[0]].values())
    stamp = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "label": a.label, "date": stamp.isoformat(timespec="seconds"), "device": cpu_model(),
        "libtorch": libtorch_version(a.nnstrain), "commit": git_commit(),
        "model": {"n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": a.n_head, "vocab": a.vocab,
                  "parameters": nparams, "fp32_weight_bytes": 4 * nparams},
        "peak_rss_mib": {str(tp): results[tp] for tp in degrees}, "load_avg": load,
    }
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"startup_rss_{stamp:%Y%m%d-%H%M%S}"
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# Start-up host memory per rank{' (' + a.label + ')' if a.label else ''} "
             f"({stamp:%Y-%m-%d %H:%M} UTC)", "",
             f"- device: {record['device']}; LibTorch {record['libtorch']}; commit {record['commit']}",
             f"- model: GPT {a.n_layer} x {a.n_embd}, {a.n_head} heads, vocab {a.vocab}: {nparams / 1e6:.0f}M "
             f"parameters, {4 * nparams / 2**30:.2f} GiB of fp32 weights; fp32, AdamW; CPU, Gloo, OMP_NUM_THREADS=1",
             "- measured: each rank's VmHWM logged once start-up is done (model built and split, training state "
             "allocated), before the first step; load averages " + ", ".join(f"{x:.1f}" for x in load), "",
             f"| plan | largest rank peak RSS | per rank | vs {degrees[0]} |", "|---|---:|---|---:|"]
    for tp in degrees:
        peak = max(results[tp].values())
        lines.append(f"| {tp} | {peak:.0f} MiB | " + ", ".join(f"{results[tp][r]:.0f}" for r in sorted(results[tp]))
                     + f" | {peak / base:.2f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
