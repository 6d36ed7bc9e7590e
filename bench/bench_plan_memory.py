#!/usr/bin/env python3
"""The planner's per-rank memory estimate against what a rank really holds, on CPU.

For each plan, trains a GPT for a few steps and reads rank 0's peak resident
memory (VmHWM, logged as peak_mem_mb), minus the same launch's baseline: the
peak of an identical run of a tiny model (libraries, allocator, threads). The
difference is what the model's parameters, gradients, optimizer state,
activations and buffers cost; `nnstrain plan --json` gives the estimate.
Results: bench/results/plan_memory_cpu.{json,md}.
"""
import datetime, json, os, pathlib, platform, subprocess, sys, tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = os.environ.get("NNSTRAIN_BIN", str(ROOT / "build" / "nnstrain"))
DATA = ROOT / "data" / "shakespeare_char" / "train.bin"

BASE = f"""
model: {{type: gpt, args: {{vocab_size: 128, block_size: 256, n_layer: 4, n_head: 8, n_embd: 512, dropout: 0.0, bias: true}}}}
optimizer: {{type: adamw, args: {{lr: 1.0e-3}}}}
dataset: {{type: token_bin, train_args: {{path: {DATA}, dtype: uint16, seq_len: 256}}}}
compute_config: {{device: cpu}}
micro_batch_size: 8
max_train_steps: 4
log_progress_every_n_train_steps: 1
seed: 1
"""
TINY = ["--model.args.n_layer", "1", "--model.args.n_embd", "32", "--model.args.n_head", "2",
        "--micro_batch_size", "1", "--dataset.train_args.seq_len", "16"]
PLANS = [  # name, ranks, overrides
    ("dp=1", 1, []),
    ("dp=2 ZeRO-1", 2, ["--compute_config.use_zero", "true", "--pas_policy", "dp"]),
    ("tp=2", 2, ["--compute_config.plan_ngpus", "2", "--pas_policy", "tp"]),
    ("dp=1 recompute", 1, ["--model.activation_checkpointing", "true"]),
]


def run(cfg, ranks, extra, tmp, tag):
    run_dir = tmp / tag
    args = ["--config", str(cfg), "--run_dir", str(run_dir), *extra]
    cmd = [BIN, *args] if ranks == 1 else [BIN, "launch", "--nproc-per-node", str(ranks), "--", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    recs = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if '"loss"' in l]
    return max(r["peak_mem_mb"] for r in recs) * 1048576


def estimate(cfg, ranks, extra):
    out = subprocess.run([BIN, "plan", "--config", str(cfg), "--runtime-ngpus", str(ranks), "--json",
                          "--memory-budget-gb", "20", *extra], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["plan"]["estimate"]


def main():
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = pathlib.Path(t)
        cfg = tmp / "gpt.yaml"
        cfg.write_text(BASE)
        for i, (name, ranks, extra) in enumerate(PLANS):
            base = run(cfg, ranks, extra + TINY, tmp, f"base{i}")
            peak = run(cfg, ranks, extra, tmp, f"run{i}")
            est = estimate(cfg, ranks, extra)
            held = peak - base
            rows.append({"plan": name, "ranks": ranks, "measured_bytes": held, "estimated_bytes": est["total_bytes"],
                         "error": est["total_bytes"] / held - 1, "estimate": est,
                         "peak_rss_bytes": peak, "baseline_rss_bytes": base})
            print(f"{name:16s} measured {held / 2**20:8.1f} MiB  estimated {est['total_bytes'] / 2**20:8.1f} MiB  "
                  f"error {100 * rows[-1]['error']:+.1f}%")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    import torch
    meta = {"date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
            "device": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                           platform.processor()),
            "load_average": os.getloadavg()}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_memory_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# Planner memory estimate vs measured (CPU)\n", f"{meta}\n",
          "GPT 4 layers, n_embd 512, 8 heads, vocab 128, seq 256, micro-batch 8, fp32. Measured = rank 0's peak RSS "
          "minus the peak of the same launch with a tiny model.\n",
          "| plan | measured MiB | estimated MiB | error |", "|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['plan']} | {r['measured_bytes'] / 2**20:.1f} | {r['estimated_bytes'] / 2**20:.1f} | "
                  f"{100 * r['error']:+.1f}% |")
    (out / "plan_memory_cpu.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
