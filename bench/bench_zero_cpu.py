#!/usr/bin/env python3
"""ZeRO stages on CPU: tokens/s of dp2 plain vs ZeRO-1, ZeRO-2, ZeRO-3, and the
bytes each rank communicates per step against the stage's theory.

Each stage trains the same GPT for the same steps with 2 ranks (Gloo, one
thread each), repeated `--rounds` times in interleaved order (0 1 2 3 0 1 2 3
...) so that a change of the machine's load hits every stage alike; tokens/s is
the median over rounds of each run's median over its logged steps after the
first (warm-up). Plain data parallelism (stage 0), measured in the same run, is
the baseline.

Communicated bytes are what rank 0 puts into reductions and receives from
all-gathers per step (`dp_comm_mb_per_step` in metrics.jsonl, buffer bytes). The
theory, from the model's parameter count P (padded per bucket or unit to a
multiple of the ZeRO group: at most 1 element per bucket per rank) and 4-byte
fp32 gradients and parameters:
  stage 0: all-reduce of the gradients                      4P
  stage 1: reduce-scatter 4P + all-gather of the parameters 4P  = 8P
  stage 2: the same, 8P (but reduced per bucket during backward, no whole gradient kept)
  stage 3: reduce-scatter 4P + gathers: the units outside the blocks once (they
           stay gathered through backward) and every block twice (forward, and
           again before its backward) = 4P + 4(P_outer + 2 P_blocks)
On the wire a ring moves (N-1)/N of a reduce-scatter's or all-gather's buffer per
rank and 2(N-1)/N of an all-reduce's: at N = 2, half the figures above, except
stage 0's, which stays 4P. Results: bench/results/zero_cpu_<stamp>.{json,md}.
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

from bench_common import ROOT, cpu_model, git_commit, libtorch_version

BIN = pathlib.Path(os.environ.get("NNSTRAIN_BIN", ROOT / "build" / "nnstrain"))
DATA = ROOT / "data" / "shakespeare_char" / "train.bin"
LAYERS, EMBD = 4, 256
CONFIG = f"""
model: {{type: gpt, args: {{vocab_size: 65, block_size: 128, n_layer: {LAYERS}, n_head: 4, n_embd: {EMBD}, dropout: 0.0, bias: true}}}}
optimizer: {{type: adamw, args: {{lr: 1.0e-3}}, clip_gnorm: 1.0}}
dataset: {{type: token_bin, train_args: {{path: {DATA}, dtype: uint16, seq_len: 128}}}}
compute_config: {{device: cpu, backend: gloo}}
pas_policy: dp
micro_batch_size: 8
log_progress_every_n_train_steps: 1
seed: 1
"""


def run(cfg, stage, prefetch, steps, tmp, tag):
    run_dir = tmp / tag
    cmd = [str(BIN), "launch", "--nproc-per-node", "2", "--", "--config", str(cfg), "--run_dir", str(run_dir),
           "--max_train_steps", str(steps), "--compute_config.use_zero", str(stage),
           "--compute_config.zero_prefetch", str(prefetch)]
    p = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{tag} failed: {p.stdout}{p.stderr}")
    recs = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if '"loss"' in l]
    log = (run_dir / "logs" / "rank0.log").read_text()
    n = int(re.search(r"model gpt: (\d+) parameters", log).group(1))
    return recs, n


def theory_bytes(stage, n, layers, embd):
    block = 12 * embd * embd + 13 * embd  # attention and MLP weights and biases, two LayerNorms
    blocks, outer = layers * block, n - layers * block
    return {0: 4 * n, 1: 8 * n, 2: 8 * n, 3: 4 * n + 4 * (outer + 2 * blocks)}[stage]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if not DATA.exists():
        sys.exit(f"{DATA} missing: run `{BIN} prepare shakespeare_char` first")
    # (label, stage, zero_prefetch): ZeRO-3 also without prefetch (each block gathered only when it runs).
    stages = [("0", 0, 1), ("1", 1, 1), ("2", 2, 1), ("3", 3, 1), ("3, no prefetch", 3, 0)]
    tok = {label: [] for label, _, _ in stages}
    comm, nparams = {}, 0
    with tempfile.TemporaryDirectory() as t:
        tmp = pathlib.Path(t)
        cfg = tmp / "gpt.yaml"
        cfg.write_text(CONFIG)
        for r in range(a.rounds):
            for label, s, pf in stages:
                recs, nparams = run(cfg, s, pf, a.steps, tmp, f"z{s}_p{pf}_r{r}")
                tok[label].append(statistics.median(x["tokens_per_s"] for x in recs[1:]))
                comm[label] = statistics.median(x["dp_comm_mb_per_step"] for x in recs[1:]) * 1048576
                print(f"round {r} stage {label}: {tok[label][-1]:.0f} tok/s, {comm[label] / 1048576:.2f} MiB/step",
                      flush=True)
    base = statistics.median(tok["0"])
    rows = []
    for label, s, _ in stages:
        th = theory_bytes(s, nparams, LAYERS, EMBD)
        rows.append({"stage": label, "tokens_per_s": statistics.median(tok[label]), "runs": tok[label],
                     "vs_plain": statistics.median(tok[label]) / base, "comm_bytes_per_step": comm[label],
                     "theory_bytes_per_step": th, "comm_vs_theory": comm[label] / th})
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": cpu_model(),
            "libtorch": libtorch_version(BIN), "commit": git_commit(), "load_average": os.getloadavg(),
            "model": f"GPT {LAYERS} layers, n_embd {EMBD}, {nparams} parameters, fp32, 2 ranks x 8 x 128 tokens",
            "steps": a.steps, "rounds": a.rounds}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ROOT / "bench" / "results" / f"zero_cpu_{stamp}"
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# ZeRO stages on CPU, dp 2 (Gloo)", "", f"{meta}", "",
             "| stage | tokens/s (median of rounds) | vs plain dp | bytes per step (rank 0) | theory | measured / theory |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['stage']} | {r['tokens_per_s']:.0f} | {r['vs_plain']:.2f} | {r['comm_bytes_per_step']:.0f} | "
                     f"{r['theory_bytes_per_step']} | {r['comm_vs_theory']:.4f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {out}.md")


if __name__ == "__main__":
    main()
