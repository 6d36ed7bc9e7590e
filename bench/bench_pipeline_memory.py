#!/usr/bin/env python3
"""Memory per pipeline rank against the planner's estimate, on CPU (issue 21, "Planner accuracy").

A GPT whose activations matter (8 layers x 128, 4 heads, 256-token sequences,
vocabulary 64, about 1.6 M parameters, tied embedding and head) trains 3
steps of 8 micro-batches of 2 sequences (one pipeline flush per step) under
every scheduler (gpipe, 1f1b, 1f1b_interleaved, zb1p, zbv) at pp 2 and pp 4
(pas_policy dp, so the only split is the pipeline's; fp32, no recompute, no
ZeRO; one process per rank over Gloo, OMP_NUM_THREADS=1), and 1f1b, zb1p and
zbv at pp 4 with every layer recomputed (model.activation_checkpointing).
Under zb1p and zbv the backward is split: a micro-batch's activations go at
its I, and what its W needs (each linear's input and output gradient) stays
until its W. Per pipeline rank:
- measured: the largest `peak_tensor_mb_per_pp_rank` over the steps (the
  CPU's counting allocator: state plus what the schedule held at its peak);
- estimate: plan.json's `estimate.pp_rank_bytes` for that rank (the cost
  model's memory of what the rank holds at its peak, docs/parallelism.md).
The baseline is one process (no pipeline) in the same run, its peak beside
its estimate. Goal: every rank within 10% of its estimate.

The memory model follows each schedule's order (trainer/plan/cost/pipeline.cpp: a
micro-batch's activations live from its F until its B or I, W's inputs from
its I until its W), so re-run this
after a change to the schedule generators:

  /root/.cache/nnstrain/venv/bin/python bench/bench_pipeline_memory.py --nnstrain build/nnstrain

Writes bench/results/pipeline_memory_<UTC time>.json and .md.
"""
import datetime
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import machine_line, parse_args, random_tokens, result_record, run_ranks, write_result  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "integration" / "configs" / "tiny_dp.yaml"
SEQ, HIDDEN, HEADS, LAYERS, VOCAB = 256, 128, 4, 8, 64
MICRO, NMICROS, STEPS = 2, 8, 3
SCHEDULERS = ("gpipe", "1f1b", "1f1b_interleaved", "zb1p", "zbv")
RECOMPUTED = ("1f1b", "zb1p", "zbv")  # at pp 4
GOAL = 0.10


def run(binary, data, work, scheduler=None, pp=1, recompute=False):
    name = (f"{scheduler}_pp{pp}" if scheduler else "one_process") + ("_recompute" if recompute else "")
    run_dir = work / name
    args = ["--config", str(CONFIG), "--run_dir", str(run_dir), "--vars.data", str(data), "--vars.seq_len", str(SEQ),
            "--model.args.n_layer", str(LAYERS), "--model.args.n_embd", str(HIDDEN), "--model.args.n_head",
            str(HEADS), "--model.args.vocab_size", str(VOCAB), "--micro_batch_size", str(MICRO),
            "--global_batch_size", str(MICRO * NMICROS), "--max_train_steps", str(STEPS),
            "--compute_config.reducer_bucket_cap_mb", "25", "--compute_config.collective_timeout_s", "600",
            "--log_progress_every_n_train_steps", "1"]
    if scheduler:
        args += ["--compute_config.pas_config.pp_size", str(pp), "--compute_config.pas_config.pipeline_scheduler",
                 scheduler]
    if recompute:
        args += ["--model.activation_checkpointing", "true"]
    run_ranks(binary, pp, args)
    plan = json.loads((run_dir / "plan.json").read_text())
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    recs = [r for r in recs if "peak_tensor_mb" in r]
    est = plan["estimate"]
    if scheduler:
        pipe = plan["pipeline"]
        measured = [max(r["peak_tensor_mb_per_pp_rank"][k] for r in recs) for k in range(pp)]
        estimate = [b / 2**20 for b in est["pp_rank_bytes"]]
    else:
        pipe = {"stages": 1, "stage_layers": [LAYERS]}
        measured = [max(r["peak_tensor_mb"] for r in recs)]
        estimate = [est["total_bytes"] / 2**20]
    return {"scheduler": scheduler or "none", "pp": pp, "recompute": sum(plan["recompute"]), "stages": pipe["stages"], "stage_layers": pipe["stage_layers"],
            "measured_mib": measured, "estimate_mib": estimate,
            "error": [m / e - 1 for m, e in zip(measured, estimate)], "loss_last": recs[-1]["loss"]}


def main():
    a = parse_args(__doc__)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as work:
        tmp = pathlib.Path(work)
        data = random_tokens(tmp / "tokens.bin", VOCAB, 200_000)
        rows = [run(a.nnstrain, data, tmp)]
        print(rows[-1], flush=True)
        for pp in (2, 4):
            for s in SCHEDULERS:
                rows.append(run(a.nnstrain, data, tmp, s, pp))
                print(rows[-1], flush=True)
        for s in RECOMPUTED:
            rows.append(run(a.nnstrain, data, tmp, s, 4, recompute=True))
            print(rows[-1], flush=True)
    worst = max(abs(e) for r in rows for e in r["error"])
    out = result_record(a.nnstrain, stamp, rows=rows, worst_error=worst, goal=GOAL,
                        model=f"GPT {LAYERS} x {HIDDEN}, {HEADS} heads, vocab {VOCAB}, tied; {NMICROS} micro-batches of "
                              f"{MICRO} x {SEQ} tokens per step; fp32, no ZeRO, pas_policy dp")
    lines = [f"# Memory per pipeline rank against the planner's estimate, CPU ({stamp:%Y-%m-%d %H:%M} UTC)", "",
             machine_line(out),
             f"- model: {out['model']}; Gloo, OMP_NUM_THREADS=1 per rank; baseline one process in the same run",
             "- measured = the largest `peak_tensor_mb_per_pp_rank` of the rank over the run's steps; estimate = "
             "plan.json `estimate.pp_rank_bytes` (one process: `peak_tensor_mb` against `estimate.total_bytes`)",
             f"- goal: every rank within {100 * GOAL:.0f}% of its estimate; worst here {100 * worst:.1f}%", "",
             "| scheduler | pp | stages (layers) | recomputed layers | pipeline rank | measured | estimate | "
             "measured / estimate - 1 |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        layers = "+".join(map(str, r["stage_layers"]))
        for k, (m, e, err) in enumerate(zip(r["measured_mib"], r["estimate_mib"], r["error"])):
            flag = "" if abs(err) <= GOAL else " **over**"
            lines.append(f"| {r['scheduler']} | {r['pp']} | {r['stages']} ({layers}) | {r['recompute']} | {k} | {m:.2f} MiB | "
                         f"{e:.2f} MiB | {100 * err:+.1f}%{flag} |")
    write_result(a.out, "pipeline_memory", stamp, out, lines)


if __name__ == "__main__":
    main()
