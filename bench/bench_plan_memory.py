#!/usr/bin/env python3
"""The planner's per-rank memory estimate against what a rank really holds, on CPU.

Measured: metrics.jsonl's `peak_tensor_mb`, the most tensor bytes any rank held
at once during a logged step, counted by the trainer's counting CPU allocator
(trainer/train/cpu_memory.h: every tensor storage's bytes from allocation to
free; what the CUDA caching allocator's allocated-bytes peak is on a GPU). The
largest over the run's logged steps is taken. Estimated: `nnstrain plan --json`'s
`estimate.total_bytes` for the same config and world (params + grads +
optimizer + activations + transient, per rank). Neither counts what is not a
tensor (libraries, threads, Gloo's buffers, malloc's overhead).

For each plan a GPT (4 layers x 512, 8 heads, vocabulary 8192, micro-batch 8 x
256 tokens, fp32 unless the row says otherwise, no dropout), or for the Llama
rows a Llama of the same size (SwiGLU 1536, 4 key/value heads), trains a few steps,
one process per rank (OMP_NUM_THREADS=1). A plan the trainer refuses, or runs
without the sharding its ZeRO stage names (rank 0's start-up line of state
bytes per parameter shows whole gradients under ZeRO-2 or whole parameters
under ZeRO-3), is reported "not run" with the reason.

Results: bench/results/plan_memory_cpu.{json,md}.

Usage (from the repository root):
  ~/.cache/nnstrain/venv/bin/python bench/bench_plan_memory.py [--nnstrain build/nnstrain] [--steps 3] [--only NAME ...]
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import ROOT, cpu_model, git_commit, libtorch_version  # noqa: E402

DATA = ROOT / "data" / "shakespeare_char" / "train.bin"
MODEL = "{vocab_size: 8192, block_size: 256, n_layer: 4, n_head: 8, n_embd: 512, dropout: 0.0, bias: true}"
CONFIG = f"""
model: {{type: gpt, args: {MODEL}}}
optimizer: {{type: adamw, args: {{lr: 1.0e-3}}}}
dataset: {{type: token_bin, train_args: {{path: {{DATA}}, dtype: uint16, seq_len: 256}}}}
compute_config: {{device: cpu}}
micro_batch_size: 8
max_train_steps: 3
log_progress_every_n_train_steps: 1
seed: 1
"""
# A Llama of the same size: SwiGLU, RMSNorm, grouped key/value heads, untied head.
LLAMA = ["--model.type", "llama", "--model.args", "{vocab_size: 8192, hidden_size: 512, intermediate_size: 1536, "
         "num_hidden_layers: 4, num_attention_heads: 8, num_key_value_heads: 4, max_position_embeddings: 256, "
         "tie_word_embeddings: false}"]
DP, TP = ["--pas_policy", "dp"], ["--pas_policy", "tp", "--compute_config.plan_ngpus", "2"]
CHUNKED = ["--model.loss", "chunked", "--model.loss_chunk_size", "512"]
DEEP = ["--model.args.n_layer", "12", "--micro_batch_size", "2"]
PLANS = [  # name, ranks, overrides
    ("dp1", 1, []),
    ("dp2 ZeRO-1", 2, DP + ["--compute_config.use_zero", "1"]),
    ("dp2 ZeRO-2", 2, DP + ["--compute_config.use_zero", "2"]),
    ("dp4 ZeRO-3", 4, DP + ["--compute_config.use_zero", "3"]),
    ("tp2 SP off", 2, TP + ["--compute_config.sequence_parallel", "false"]),
    ("tp2 SP", 2, TP),
    ("dp1 recompute", 1, ["--model.activation_checkpointing", "true"]),
    ("dp1 chunked loss", 1, CHUNKED),
    ("dp1 bf16-mixed", 1, ["--precision", "bf16-mixed"]),
    # The chunked loss leaves the blocks' backward as the peak, where ZeRO-2's
    # buckets and ZeRO-3's gathered units live.
    ("dp2 ZeRO-2 chunked loss", 2, DP + CHUNKED + ["--compute_config.use_zero", "2"]),
    ("dp4 ZeRO-3 chunked loss", 4, DP + CHUNKED + ["--compute_config.use_zero", "3"]),
    # 12 layers, micro-batch 2: the state outweighs the activations, as where ZeRO-3 is chosen.
    ("12 layers b2 dp4 ZeRO-2 chunked loss", 4, DEEP + DP + CHUNKED + ["--compute_config.use_zero", "2"]),
    ("12 layers b2 dp4 ZeRO-3 chunked loss", 4, DEEP + DP + CHUNKED + ["--compute_config.use_zero", "3"]),
    ("Llama dp1", 1, LLAMA),
    ("Llama dp1 bf16-mixed", 1, LLAMA + ["--precision", "bf16-mixed"]),
    ("Llama tp2 SP", 2, LLAMA + TP),
    # Combinations: 2D (tp inside, ZeRO-3 across dp) with recompute in bf16; hybrid sharding.
    ("tp2 x dp2 ZeRO-3 recompute bf16-mixed", 4, ["--pas_policy", "hybrid", "--compute_config.plan_ngpus", "2",
                                                  "--compute_config.use_zero", "3", "--model.activation_checkpointing",
                                                  "true", "--precision", "bf16-mixed"]),
    ("dp4 ZeRO-3 zero_ngroups 2 chunked loss", 4, DP + CHUNKED + ["--compute_config.use_zero", "3",
                                                                  "--compute_config.zero_ngroups", "2"]),
]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


HELD = re.compile(r"state bytes/param ([\d.]+) \(param ([\d.]+), grad ([\d.]+), master ([\d.]+), moments ([\d.]+)\)")


def measure(binary, cfg, ranks, extra, run_dir, steps):
    """(the largest peak_tensor_mb over the logged steps in bytes, rank 0's held
    state bytes per parameter {param, grad, ...}), or (None, the error line)."""
    args = ["--config", str(cfg), "--run_dir", str(run_dir), "--max_train_steps", str(steps), *extra]
    cmd = [binary, *args] if ranks == 1 else [binary, "launch", "--nproc-per-node", str(ranks), "--", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        lines = [l for l in (p.stdout + p.stderr).splitlines() if "error" in l.lower()] or (p.stdout + p.stderr).splitlines()
        return None, (lines[-1] if lines else f"exit {p.returncode}")[-300:]
    recs = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if '"loss"' in l]
    m = HELD.search(p.stdout + p.stderr)
    held = dict(zip(["total", "param", "grad", "master", "moments"], map(float, m.groups()))) if m else None
    return max(r["peak_tensor_mb"] for r in recs) * 1048576, held


def unsharded(zero, held, full):
    """Why a run did not hold what its ZeRO stage shards (a build that runs the
    stage as a lower one), or None. full: the bytes per parameter without ZeRO."""
    if held is None:
        return None
    if zero >= 2 and held["grad"] >= full["grad"]:
        return f"ZeRO-{zero} ran with whole gradients (rank 0 held {held['grad']:.2f} gradient bytes per parameter): not implemented in this build"
    if zero >= 3 and held["param"] >= full["param"]:
        return f"ZeRO-3 ran with whole parameters (rank 0 held {held['param']:.2f} parameter bytes per parameter): not implemented in this build"
    return None


def estimate(binary, cfg, ranks, extra):
    p = subprocess.run([binary, "plan", "--config", str(cfg), "--runtime-ngpus", str(ranks), "--json",
                        "--memory-budget-gb", "100", *extra], cwd=ROOT, env=env(), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"nnstrain plan failed for {extra}:\n{p.stdout}{p.stderr}")
    j = json.loads(p.stdout)
    return j["plan"], j["state_bytes_per_param"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nnstrain", default=os.environ.get("NNSTRAIN_BIN", str(ROOT / "build" / "nnstrain")))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="plan names to run (default: all)")
    a = ap.parse_args()
    binary = str(pathlib.Path(a.nnstrain).resolve())
    if not DATA.is_file():
        sys.exit(f"{DATA} is missing: run `{binary} prepare shakespeare_char` first")
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = pathlib.Path(t)
        cfg = tmp / "gpt.yaml"
        cfg.write_text(CONFIG.replace("{DATA}", str(DATA)))
        for i, (name, ranks, extra) in enumerate(PLANS):
            if a.only and name not in a.only:
                continue
            plan, full = estimate(binary, cfg, ranks, extra)
            est = plan["estimate"]
            measured, held = measure(binary, cfg, ranks, extra, tmp / f"run{i}", a.steps)
            error = held if measured is None else unsharded(plan["zero"], held, full)
            if error:
                measured = None
            row = {"plan": name, "ranks": ranks, "overrides": extra, "tp": plan["tp"], "dp": plan["dp"],
                   "zero": plan["zero"], "estimated_bytes": est["total_bytes"], "estimate": est,
                   "measured_bytes": measured, "error": None if measured is None else est["total_bytes"] / measured - 1,
                   "not_run": error, "held_bytes_per_param": None if isinstance(held, str) else held}
            rows.append(row)
            if measured is None:
                print(f"{name:40s} not run: {error}", flush=True)
            else:
                print(f"{name:40s} measured {measured / 2**20:8.1f} MiB  estimated {est['total_bytes'] / 2**20:8.1f} MiB"
                      f"  error {100 * row['error']:+.1f}%", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(), "libtorch": libtorch_version(binary), "device": cpu_model(),
            "load_average": [round(x, 2) for x in os.getloadavg()], "steps": a.steps}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_memory_cpu.json").write_text(json.dumps({"meta": meta, "model": MODEL, "rows": rows}, indent=1) + "\n")
    md = ["# Planner memory estimate vs measured (CPU)", "",
          f"{meta['date']}, {meta['device']}, LibTorch {meta['libtorch']}, commit {meta['commit']}, "
          f"load average {meta['load_average']}.", "",
          f"GPT {MODEL} (Llama rows: {' '.join(LLAMA[3:])}), micro-batch 8 x 256 tokens, fp32 unless named, {a.steps} steps, one process per rank. "
          "Measured: the largest `peak_tensor_mb` of the logged steps (the most tensor bytes any rank held at once, "
          "from the counting CPU allocator). Estimated: `nnstrain plan --json` total per rank. "
          "Error = estimated / measured - 1.", "",
          "| plan | ranks | measured MiB | estimated MiB | error | params | grads | optimizer | activations | transient |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["estimate"]
        parts = " | ".join(f"{e[k] / 2**20:.1f}" for k in
                           ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "transient_bytes"))
        if r["measured_bytes"] is None:
            md.append(f"| {r['plan']} | {r['ranks']} | not run | {r['estimated_bytes'] / 2**20:.1f} | | {parts} |")
        else:
            md.append(f"| {r['plan']} | {r['ranks']} | {r['measured_bytes'] / 2**20:.1f} | "
                      f"{r['estimated_bytes'] / 2**20:.1f} | {100 * r['error']:+.1f}% | {parts} |")
    notes = [r for r in rows if r["not_run"]]
    if notes:
        md += ["", "Not run (the trainer refused the plan, or ran it without the sharding it names):", ""]
        md += [f"- {r['plan']}: `{r['not_run']}`" for r in notes]
    (out / "plan_memory_cpu.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
