#!/usr/bin/env python3
"""The LM head's loss on CPU: plain vs chunked vs fused (model.loss), step time
and the tensors held at the step's peak, for GPT and Llama.

Each case trains a few steps in one process (OMP_NUM_THREADS = --threads),
once per loss, alternating the losses within each repeat; the repeat with the
best median ms/step is kept per loss (the machine is shared). Read from
metrics.jsonl: ms_per_step (the median of the logged steps after the first),
peak_tensor_mb (the largest over them: every tensor byte held at once, from the
trainer's counting CPU allocator) and the last step's loss, whose difference
from the plain loss's shows the losses train the same model.

Results: bench/results/fused_loss_cpu_<UTC time>.{json,md}.

Usage (from the repository root, after `nnstrain prepare shakespeare_char`):
  ~/.cache/nnstrain/venv/bin/python bench/bench_fused_loss_cpu.py [--nnstrain build/nnstrain] [--steps 6] [--repeats 2]
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import ROOT, cpu_model, git_commit, libtorch_version  # noqa: E402

DATA = ROOT / "data" / "shakespeare_char"
COMMON = ["--compute_config.device", "cpu", "--val_every_n_train_steps", "0", "--log_progress_every_n_train_steps",
          "1", "--checkpoint.every_n_train_steps", "0"]
# name, config, overrides, chunk size (the same for chunked and fused)
CASES = [
    # shakespeare_char's model at a quarter of its batch (16 x 256 tokens, chunks of 1024): the full
    # 64 x 256 took minutes per step on the shared 2-core machine.
    ("GPT shakespeare_char (6 x 384, vocab 65, 16 x 256 tokens)", "configs/shakespeare_char.yaml",
     ["--micro_batch_size", "16"], 1024),
    ("Llama llama3_mini (4 x 256, vocab 65, 8 x 128 tokens)", "configs/llama3_mini.yaml", [], 256),
    ("GPT 4 x 512, vocab 8192, 8 x 256 tokens", "configs/shakespeare_char.yaml",
     ["--model.args", "{vocab_size: 8192, block_size: 256, n_layer: 4, n_head: 8, n_embd: 512, dropout: 0.0, "
      "bias: true}", "--micro_batch_size", "8"], 512),
    ("Llama llama3_mini, vocab 32000 untied (8 x 128 tokens)", "configs/llama3_mini.yaml",
     ["--model.args.vocab_size", "32000", "--model.args.tie_word_embeddings", "false"], 256),
]
LOSSES = ["plain", "chunked", "fused"]


def run(binary, cfg, extra, loss, chunk, steps, threads, run_dir):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    args = [binary, "--config", cfg, "--run_dir", str(run_dir), "--max_train_steps", str(steps),
            "--vars.data_dir", str(DATA), *COMMON, *extra, "--model.loss", loss, "--model.loss_chunk_size", str(chunk)]
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"nnstrain failed ({p.returncode}): {' '.join(args)}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    recs = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if '"loss"' in l]
    timed = recs[1:] or recs
    return {"ms_per_step": statistics.median(r["ms_per_step"] for r in timed),
            "peak_tensor_mb": max(r.get("peak_tensor_mb", float("nan")) for r in timed),
            "last_loss": recs[-1]["loss"], "losses": [r["loss"] for r in recs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nnstrain", default=os.environ.get("NNSTRAIN_BIN", str(ROOT / "build" / "nnstrain")))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", type=int, nargs="*", help="case indices to run")
    a = ap.parse_args()
    binary = str(pathlib.Path(a.nnstrain).resolve())
    if not (DATA / "train.bin").is_file():
        sys.exit(f"{DATA}/train.bin is missing: run `{binary} prepare shakespeare_char` first")
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as t:
        for i, (name, cfg, extra, chunk) in enumerate(CASES):
            if a.only and i not in a.only:
                continue
            best = {}
            for rep in range(a.repeats):
                for loss in LOSSES:
                    r = run(binary, cfg, extra, loss, chunk, a.steps, a.threads, pathlib.Path(t) / f"c{i}_{loss}_{rep}")
                    if loss not in best or r["ms_per_step"] < best[loss]["ms_per_step"]:
                        best[loss] = r
                    print(f"{name}: {loss:8s} {r['ms_per_step']:9.1f} ms/step  peak {r['peak_tensor_mb']:8.1f} MiB  "
                          f"loss {r['last_loss']:.6f}", flush=True)
            plain = best["plain"]
            for loss in LOSSES:
                b = best[loss]
                rows.append({"case": name, "loss": loss, "chunk": chunk, **b,
                             "speed_vs_plain": plain["ms_per_step"] / b["ms_per_step"],
                             "max_rel_loss_diff_vs_plain": max(abs(x - y) / abs(y)
                                                               for x, y in zip(b["losses"], plain["losses"]))})
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(), "libtorch": libtorch_version(binary), "device": cpu_model(),
            "threads": a.threads, "steps": a.steps, "repeats": a.repeats,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fused_loss_cpu_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = ["# LM-head loss on CPU: plain vs chunked vs fused", "",
          f"{meta['date']}, {meta['device']}, LibTorch {meta['libtorch']}, commit {meta['commit']}, "
          f"{a.threads} thread(s), {a.steps} steps (the first not timed), best of {a.repeats} alternating repeats; "
          f"load average before {meta['load_average_before']}, after {meta['load_average_after']}.", "",
          "ms/step: median of the logged steps; peak: the largest `peak_tensor_mb` (every tensor byte held at once); "
          "loss diff: the largest relative difference of a step's loss from the plain loss's.", "",
          "| case | loss | chunk | ms/step | speed vs plain | peak tensor MiB | loss diff vs plain |",
          "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['case']} | {r['loss']} | {r['chunk'] if r['loss'] != 'plain' else ''} | "
                  f"{r['ms_per_step']:.1f} | {r['speed_vs_plain']:.3f} | {r['peak_tensor_mb']:.1f} | "
                  f"{r['max_rel_loss_diff_vs_plain']:.1e} |")
    (out / f"fused_loss_cpu_{stamp}.md").write_text("\n".join(md) + "\n")
    print(out / f"fused_loss_cpu_{stamp}.md")


if __name__ == "__main__":
    sys.exit(main())
