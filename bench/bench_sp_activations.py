#!/usr/bin/env python3
"""Activation memory per rank with and without sequence parallelism, on CPU.

A GPT whose activations dwarf its weights (2 layers x 512, 8 heads, vocabulary
256, micro-batch 8 x 1024 tokens, no dropout: the fused attention kernel then
keeps no [T x T] scores) is
trained for 2 steps at tp 1, 2, 4, with compute_config.sequence_parallel true
and false (one process per rank, Gloo, OMP_NUM_THREADS=1). Per run:
- start-up: rank 0's tensor bytes in use once the model and training state
  are built (its log's `start-up ... tensors in use`);
- after step 1: the step's peak tensor bytes (metrics.jsonl `peak_tensor_mb`,
  the largest over the ranks; docs/observability.md), i.e. start-up plus what
  the first forward/backward held at its peak;
- activations = the difference: bytes kept for backward (the norms' and
  residuals' inputs and outputs that sequence parallelism splits, and the
  rest) plus backward's transients;
- held by forward: metrics.jsonl `activation_mb` of step 1, rank 0's tensor
  bytes in use right after the forward minus right before it: what forward
  keeps for backward, without backward's transients.

(Results before the counting CPU allocator used peak RSS and malloc's bytes.)

Writes bench/results/sp_activations_<UTC time>.json and .md.

Usage (from the repository root):
  /root/.cache/nnstrain/venv/bin/python bench/bench_sp_activations.py --nnstrain build/nnstrain
"""
import datetime
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import (machine_line, parse_args, result_record, run_ranks, startup_tensors_mib,  # noqa: E402
                          step_record, write_result)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "integration" / "configs" / "tiny_dp.yaml"
SEQ, BATCH, EMBD, LAYERS = 1024, 8, 512, 2


def run(binary, tp, sp, data, work):
    run_dir = work / f"tp{tp}_sp{int(sp)}"
    args = ["--config", str(CONFIG), "--run_dir", str(run_dir), "--vars.data", str(data), "--vars.seq_len", str(SEQ),
            "--model.args.n_layer", str(LAYERS), "--model.args.n_embd", str(EMBD), "--model.args.n_head", "8",
            "--model.args.vocab_size", "256", "--model.args.dropout", "0.0", "--micro_batch_size", str(BATCH),
            "--global_batch_size", str(BATCH), "--max_train_steps", "2", "--compute_config.reducer_bucket_cap_mb", "25",
            "--compute_config.sequence_parallel", "true" if sp else "false"]
    if tp > 1:
        args += ["--compute_config.plan_ngpus", str(tp), "--pas_policy", "tp"]
    run_ranks(binary, tp, args)
    startup = startup_tensors_mib(run_dir)
    step1 = step_record(run_dir, 1)
    peak = step1["peak_tensor_mb"]  # MiB (bytes / 2^20); the largest over the ranks
    return {"tp": tp, "sp": sp, "startup_mib": startup, "peak_step1_mib": peak, "activations_mib": peak - startup,
            "held_by_forward_mib": step1["activation_mb"]}


def main():
    a = parse_args(__doc__)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        data = tmp / "tokens.bin"
        np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint16).tofile(data)
        for tp, sp in ((1, False), (2, False), (2, True), (4, False), (4, True)):
            rows.append(run(a.nnstrain, tp, sp, data, tmp))
            print(rows[-1], flush=True)
    base = rows[0]["activations_mib"]
    base_held = rows[0]["held_by_forward_mib"]
    per_layer_tensor = SEQ * BATCH * EMBD * 4 / 2**20
    out = result_record(a.nnstrain, stamp, rows=rows,
                        model=f"GPT {LAYERS} x {EMBD}, 8 heads, vocab 256, no dropout; micro-batch {BATCH} x {SEQ} "
                              "tokens; fp32")
    lines = [f"# Activation memory per rank, tensor parallelism with and without sequence parallelism "
             f"({stamp:%Y-%m-%d %H:%M} UTC)", "", machine_line(out),
             f"- model: {out['model']}; Gloo, OMP_NUM_THREADS=1 per rank; one [b, s, h] fp32 tensor = "
             f"{per_layer_tensor:.0f} MiB",
             "- activations = step 1's peak tensor bytes (`peak_tensor_mb`) minus rank 0's tensor bytes in use "
             "after start-up (model and training state built): what forward kept for backward plus backward's "
             "transients",
             "- held by forward = rank 0's tensor bytes in use after step 1's forward minus before it "
             "(metrics `activation_mb`): what forward keeps for backward", "",
             "| tp | sequence parallel | start-up tensors | peak over step 1 | activations (peak) | vs tp=1 | "
             "held by forward | vs tp=1 |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tp']} | {'on' if r['sp'] else 'off'} | {r['startup_mib']:.0f} MiB | "
                     f"{r['peak_step1_mib']:.0f} MiB | {r['activations_mib']:.0f} MiB | "
                     f"{r['activations_mib'] / base:.2f} | {r['held_by_forward_mib']:.0f} MiB | "
                     f"{r['held_by_forward_mib'] / base_held:.2f} |")
    write_result(a.out, "sp_activations", stamp, out, lines)


if __name__ == "__main__":
    main()
