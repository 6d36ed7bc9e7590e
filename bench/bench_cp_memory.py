#!/usr/bin/env python3
"""Memory per rank under context parallelism, on CPU (issue 22).

A Llama whose activations are dominated by the sequence (2 layers x 128, 4
query heads over 2 KV heads, vocabulary 256, about 0.2 M parameters) trains 2
steps of one 4096-token sequence at cp 1, 2 and 4 (zigzag, p2p; one process
per rank over Gloo, OMP_NUM_THREADS=1). Per run:
- peak: step 1's peak tensor bytes (metrics.jsonl `peak_tensor_mb`, the largest
  over the ranks: start-up state plus what forward/backward held at its peak);
- start-up: rank 0's tensor bytes in use once model and training state are built;
- held by forward: metrics.jsonl `activation_mb` of step 1 (rank 0's tensor
  bytes after the forward minus before it: what forward keeps for backward;
  not measured under pp, whose forwards interleave with backwards);
- the planner's estimate of the same run (plan.json `estimate`: activations,
  and the total it compares with peak_tensor_mb).
The baseline is cp 1, measured in the same run. Goal: cp 4's peak at most 0.35
of cp 1's.

--pp 2: the same under pipeline parallelism (cp x pp, 2 to 8 processes; the
layers split over the stages, the peak the busiest stage's), baseline cp 1 at
pp 2.

Writes bench/results/cp_memory_<UTC time>.json and .md (cp_memory_pp<N>_... with --pp).

Usage (from the repository root):
  /root/.cache/nnstrain/venv/bin/python bench/bench_cp_memory.py --nnstrain build/nnstrain [--pp 2]
"""
import datetime
import json
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import (machine_line, parse_args, result_record, run_ranks, startup_tensors_mib,  # noqa: E402
                          step_record, write_result)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "integration" / "configs" / "tiny_llama.yaml"
SEQ, HIDDEN, LAYERS, VOCAB = 4096, 128, 2, 256


def run(binary, cp, pp, data, work):
    run_dir = work / f"cp{cp}"
    args = ["--config", str(CONFIG), "--run_dir", str(run_dir), "--vars.data", str(data), "--vars.seq_len", str(SEQ),
            "--model.args.hidden_size", str(HIDDEN), "--model.args.intermediate_size", str(2 * HIDDEN),
            "--model.args.num_hidden_layers", str(LAYERS), "--model.args.vocab_size", str(VOCAB),
            "--micro_batch_size", "1", "--global_batch_size", "1", "--max_train_steps", "2",
            "--compute_config.reducer_bucket_cap_mb", "25", "--compute_config.context_parallel_size", str(cp),
            "--compute_config.collective_timeout_s", "600", "--compute_config.pas_config.pp_size", str(pp)]
    run_ranks(binary, cp * pp, args)
    startup = startup_tensors_mib(run_dir)
    step1 = step_record(run_dir, 1)
    est = json.loads((run_dir / "plan.json").read_text())["estimate"]
    return {"cp": cp, "startup_mib": startup, "peak_step1_mib": step1["peak_tensor_mb"],
            "held_by_forward_mib": step1.get("activation_mb"), "loss_step1": step1["loss"],
            "plan_activation_mib": est["activation_bytes"] / 2**20, "plan_total_mib": est["total_bytes"] / 2**20,
            "plan_context": json.loads((run_dir / "plan.json").read_text()).get("context", {"cp": 1})}


def main():
    a = parse_args(__doc__, lambda ap: ap.add_argument("--pp", type=int, default=1, help="pipeline ranks (pp_size)"))
    stamp = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        data = tmp / "tokens.bin"
        np.random.default_rng(0).integers(0, VOCAB, 100_000, dtype=np.uint16).tofile(data)
        for cp in (1, 2, 4):
            rows.append(run(a.nnstrain, cp, a.pp, data, tmp))
            print(rows[-1], flush=True)
    base = rows[0]
    out = result_record(a.nnstrain, stamp, rows=rows,
                        model=f"Llama {LAYERS} x {HIDDEN}, 4 heads / 2 KV heads, ffn {2 * HIDDEN}, vocab {VOCAB}; one "
                              f"sequence of {SEQ} tokens per step; fp32, plain loss, no recompute; cp_comm_type p2p, "
                              "zigzag" + (f"; pp {a.pp} (1f1b, a layer per stage)" if a.pp > 1 else ""), pp=a.pp)
    with_pp = f" x pp {a.pp}" if a.pp > 1 else ""
    lines = [f"# Memory per rank under context parallelism{with_pp}, CPU ({stamp:%Y-%m-%d %H:%M} UTC)", "",
             machine_line(out),
             f"- model: {out['model']}; Gloo, OMP_NUM_THREADS=1 per rank; baseline cp 1{with_pp} in the same run",
             "- peak = step 1's `peak_tensor_mb` (largest over the ranks); start-up = rank 0's tensors in use once "
             "model and state are built; held by forward = step 1's `activation_mb` (rank 0)",
             "- planner = plan.json's estimate for the same run (activations; total, which `peak_tensor_mb` is "
             "compared with)", "",
             "| cp | start-up | peak step 1 | peak vs cp 1 | held by forward | vs cp 1 | planner activations | "
             "planner total | peak / planner total | loss step 1 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    def held(r):  # by forward, and vs cp 1
        if r["held_by_forward_mib"] is None:
            return "- | -"
        return f"{r['held_by_forward_mib']:.1f} MiB | {r['held_by_forward_mib'] / base['held_by_forward_mib']:.3f}"
    for r in rows:
        lines.append(f"| {r['cp']} | {r['startup_mib']:.1f} MiB | {r['peak_step1_mib']:.1f} MiB | "
                     f"{r['peak_step1_mib'] / base['peak_step1_mib']:.3f} | {held(r)} | "
                     f"{r['plan_activation_mib']:.1f} MiB | {r['plan_total_mib']:.1f} MiB | "
                     f"{r['peak_step1_mib'] / r['plan_total_mib']:.2f} | {r['loss_step1']:.6f} |")
    write_result(a.out, "cp_memory" + (f"_pp{a.pp}" if a.pp > 1 else ""), stamp, out, lines)


if __name__ == "__main__":
    main()
