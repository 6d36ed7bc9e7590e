#!/usr/bin/env python3
"""Tensor-parallel training throughput on CPU: two nnstrain binaries, same run.

Trains the GPT of tests/integration/configs/tiny_dp.yaml scaled up (4 layers x
256, 8 heads, vocabulary 512, 128-token samples, global batch 8) at tp=2 (two
processes, Gloo, OMP_NUM_THREADS=1 each) for --steps steps, with each binary in
turn, --repeats times interleaved (A B A B ...) so that both see the same load.
Reported per binary: tokens/s over the steps after --warmup (rank 0's
metrics.jsonl: tokens_per_s per step), tokens/s at the median step, and the
best repeat by median; and the load average around each run.

Writes bench/results/tp_cpu_<UTC time>.json and .md.

Usage (from the repository root):
  /root/.cache/nnstrain/venv/bin/python bench/bench_tp_cpu.py --a /tmp/nnstrain_before --a-label before \\
      --b build/nnstrain --b-label after
"""
import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import cpu_model, git_commit, libtorch_version  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "integration" / "configs" / "tiny_dp.yaml"
SEQ, BATCH = 128, 8


def run(binary, tp, data, work, steps, extra=()):
    run_dir = work / "run"
    args = ["--config", str(CONFIG), "--run_dir", str(run_dir), "--vars.data", str(data),
            "--vars.seq_len", str(SEQ), "--model.args.n_layer", "4", "--model.args.n_embd", "256",
            "--model.args.n_head", "8", "--model.args.vocab_size", "512", "--micro_batch_size", str(BATCH),
            "--global_batch_size", str(BATCH), "--max_train_steps", str(steps),
            "--compute_config.reducer_bucket_cap_mb", "25", "--lr_scheduler.args.decay_steps", str(steps)]
    if tp > 1:
        args += ["--compute_config.plan_ngpus", str(tp), "--pas_policy", "tp"]
    args += list(extra)
    cmd = [binary, *args] if tp == 1 else [binary, "launch", "--nproc-per-node", str(tp), "--", *args]
    load0 = os.getloadavg()[0]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=1200)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in recs if "loss" in r], (load0, os.getloadavg()[0])


def summarise(recs, warmup):
    kept = recs[warmup:]
    tokens = SEQ * BATCH
    secs = [tokens / r["tokens_per_s"] for r in kept]
    return {"tokens_per_s": tokens * len(kept) / sum(secs), "median_tokens_per_s": tokens / statistics.median(secs),
            "steps_timed": len(kept), "loss_last": recs[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--a-label", default="a")
    ap.add_argument("--b", required=True)
    ap.add_argument("--b-label", default="b")
    ap.add_argument("--a-args", default="", help="extra overrides for binary a, e.g. '--compute_config.sequence_parallel false'")
    ap.add_argument("--b-args", default="", help="extra overrides for binary b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc)
    results = {a.a_label: [], a.b_label: []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        data = tmp / "tokens.bin"
        np.random.default_rng(0).integers(0, 512, 400_000, dtype=np.uint16).tofile(data)
        for k in range(a.repeats):
            for label, binary, extra in ((a.a_label, a.a, a.a_args.split()), (a.b_label, a.b, a.b_args.split())):
                work = tmp / f"{label}{k}"
                work.mkdir()
                recs, load = run(binary, a.tp, data, work, a.steps, extra)
                s = summarise(recs, a.warmup)
                s["load"] = load
                results[label].append(s)
                print(f"{label} #{k}: {s['tokens_per_s']:.0f} tok/s (median step {s['median_tokens_per_s']:.0f}), "
                      f"load {load[0]:.1f} -> {load[1]:.1f}", flush=True)
    best = {l: max(r, key=lambda s: s["median_tokens_per_s"]) for l, r in results.items()}
    out = {"date": stamp.isoformat(timespec="seconds"), "device": cpu_model(), "libtorch": libtorch_version(a.b),
           "commit": git_commit(), "tp": a.tp, "steps": a.steps, "warmup": a.warmup, "results": results, "best": best,
           "model": "GPT 4 x 256, 8 heads, vocab 512, seq 128, batch 8, fp32"}
    name = f"tp_cpu_{stamp.strftime('%Y%m%d-%H%M%S')}"
    pathlib.Path(a.out, name + ".json").write_text(json.dumps(out, indent=1))
    lines = [f"# Tensor-parallel CPU throughput, tp={a.tp}: {a.a_label} vs {a.b_label} ({stamp:%Y-%m-%d %H:%M} UTC)", "",
             f"- device: {out['device']}; LibTorch {out['libtorch']}; commit {out['commit']}",
             f"- model: {out['model']}; Gloo, OMP_NUM_THREADS=1 per rank; {a.steps} steps, first {a.warmup} "
             f"not timed; {a.repeats} repeats interleaved", "",
             "| binary | tokens/s (best repeat) | tokens/s at median step (best) | every repeat (median-step tok/s) | load averages |",
             "|---|---:|---:|---|---|"]
    for label, rs in results.items():
        b = best[label]
        every = ", ".join(f"{r['median_tokens_per_s']:.0f}" for r in rs)
        loads = ", ".join(f"{r['load'][0]:.1f}-{r['load'][1]:.1f}" for r in rs)
        lines.append(f"| {label} | {b['tokens_per_s']:.0f} | {b['median_tokens_per_s']:.0f} | {every} | {loads} |")
    ratio = best[a.b_label]["median_tokens_per_s"] / best[a.a_label]["median_tokens_per_s"]
    lines += ["", f"{a.b_label} / {a.a_label} (median step, best repeats): {ratio:.3f}"]
    pathlib.Path(a.out, name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
