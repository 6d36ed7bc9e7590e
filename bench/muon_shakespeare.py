#!/usr/bin/env python3
"""Muon + AdamW against AdamW alone on shakespeare_char (CPU): each at its best
learning rate from a small sweep, best validation loss at equal steps.

The bundled CPU config (configs/shakespeare_char_cpu.yaml: GPT 4 x 4 x 128,
block 64, batch 12, cosine schedule with 100 warmup steps to min_lr = lr / 10,
clipping at 1.0, seed 1337) trained for --steps steps (the schedule's
decay_steps follows, so every run decays to its floor at the end), once per
learning rate:

- **AdamW**: `optimizer.args.lr` in --adamw-lrs, `lr_scheduler.args.min_lr`
  = lr / 10 (the config's ratio), everything else as the config says.
- **Muon + AdamW**: `optimizer.type: muon`, `optimizer.args.lr` in --muon-lrs
  (Muon's other keys at their defaults, torch.optim.Muon's: momentum 0.95,
  Nesterov, 5 Newton-Schulz steps, weight decay 0.1, `adjust_lr_fn: original`;
  fp32 Newton-Schulz on the CPU) for the matrices inside the blocks, and
  `optimizer.adamw_args` = the config's AdamW keys (lr 1e-3, betas [0.9, 0.99],
  eps 1e-8, weight decay 0.1) for the embedding (tied with the head) and the
  norms. The schedule scales both lrs by the same factor (docs/config.md).

The two optimizers' runs alternate (AdamW lr 1, Muon lr 1, AdamW lr 2, ...), so
the load of a shared machine falls on both alike; it only changes the wall
times, not the losses (one thread, the same seed: a run is deterministic).
Evaluation every --val-every steps on the same --val-batches fixed validation
batches for every run (the trainer reads validation batch i at index i).
Per run: best validation loss and its step, final validation loss, final
train loss (the mean of the train losses logged in the last 100 steps: one
step's loss of one batch is noisy), wall time, mean ms/step and the optimizer's
share (`time_optimizer_ms`: clipping and the step). Per optimizer: the run
with the lowest best validation loss. With --extend, an optimizer whose best
lr is at an edge of its grid gets one more run beyond that edge (x2 or / 2).

Results: bench/results/muon_shakespeare_<UTC time>.{json,md}.

Usage (from the repository root, after `build/nnstrain prepare shakespeare_char`):
  ~/.cache/nnstrain/venv/bin/python bench/muon_shakespeare.py [--steps 500] [--extend] [--threads 1]
"""
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import (ROOT, binary_commit, machine_line, parse_args, result_record, run_single,  # noqa: E402
                          write_result)

CONFIG = "configs/shakespeare_char_cpu.yaml"
DATA = ROOT / "data" / "shakespeare_char"
# The config's AdamW keys, given to Muon's AdamW half as they are.
ADAMW_ARGS = "{lr: 1.0e-3, betas: [0.9, 0.99], eps: 1.0e-8, weight_decay: 0.1}"
CONFIG_ADAMW_LR = 1.0e-3


def common_overrides(a):
    """The overrides every run shares (besides --run_dir)."""
    return ["--compute_config.device", "cpu", "--vars.data_dir", str(DATA),
            "--max_train_steps", str(a.steps), "--lr_scheduler.args.decay_steps", str(a.steps),
            "--val_every_n_train_steps", str(a.val_every), "--max_val_steps", str(a.val_batches),
            "--log_progress_every_n_train_steps", "10", "--checkpoint.every_n_train_steps", "0"]


def optimizer_overrides(optimizer, lr):
    """The overrides that select the optimizer and its lr."""
    if optimizer == "adamw":
        return ["--optimizer.args.lr", f"{lr:g}", "--lr_scheduler.args.min_lr", f"{lr / 10:g}"]
    # The schedule's base is adamw_args.lr (1e-3), its floor the config's min_lr (1e-4): lr / 10 for both.
    return ["--optimizer.type", "muon", "--optimizer.args", f"{{lr: {lr:g}}}", "--optimizer.adamw_args", ADAMW_ARGS]


def check_optimizer(run_dir, optimizer):
    """The optimizer that ran, from the run's own record (active/rank0.json: the optimizer's impl and its
    state by name), not from the overrides: Muon keeps a `momentum_buffer`, AdamW alone none."""
    opt = json.loads((pathlib.Path(run_dir) / "active" / "rank0.json").read_text()).get("optimizer") or {}
    is_muon = "momentum_buffer" in opt.get("state_segments", {})
    if is_muon != (optimizer == "muon"):
        sys.exit(f"{run_dir}: asked for {optimizer}, active/rank0.json records {opt}")
    return opt


def one_run(binary, threads, run_dir, optimizer, lr, a):
    args = [binary, "--config", CONFIG, "--run_dir", str(run_dir), *common_overrides(a),
            *optimizer_overrides(optimizer, lr)]
    t0 = time.time()
    run_single(args, threads)
    wall = time.time() - t0
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r for r in recs if "loss" in r and "ms_per_step" in r]
    vals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    best_step, best = min(vals, key=lambda v: v[1])
    last = [r["loss"] for r in train if r["step"] > a.steps - 100]
    opt_ms = [r["time_optimizer_ms"] for r in train[1:] if "time_optimizer_ms" in r]
    return {"optimizer": optimizer, "lr": lr, "overrides": optimizer_overrides(optimizer, lr),
            "active_optimizer": check_optimizer(run_dir, optimizer),
            "best_val_loss": best, "best_val_step": best_step, "final_val_loss": vals[-1][1],
            "final_val_step": vals[-1][0], "final_train_loss": statistics.mean(last),
            "last_train_loss": train[-1]["loss"], "val_curve": vals, "wall_s": wall,
            "ms_per_step": statistics.median(r["ms_per_step"] for r in train[1:]),
            "optimizer_ms": statistics.median(opt_ms) if opt_ms else None}


def more(ap):
    ap.add_argument("--steps", type=int, default=500, help="training steps of every run (the config: 2000)")
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--val-batches", type=int, default=50, help="validation batches per evaluation (the config: 20)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--adamw-lrs", type=float, nargs="*", default=[5e-4, 1e-3, 2e-3])
    ap.add_argument("--muon-lrs", type=float, nargs="*", default=[0.01, 0.02, 0.04])
    ap.add_argument("--previous", help="a result .json of this script with the same common overrides: its runs "
                    "join this one's table (to widen a sweep whose best lr was at an edge)")
    ap.add_argument("--extend", action="store_true",
                    help="one more lr for an optimizer whose best is at its grid's edge")
    ap.add_argument("--note", default="", help="a remark stored with the figures (e.g. the machine was shared)")


def report(a, binary, stamp, load_before, runs):
    """Writes the result files from the runs so far (after each run: an interrupted sweep keeps what it measured)."""
    best = {opt: min((r for r in runs if r["optimizer"] == opt), key=lambda r: r["best_val_loss"])
            for opt in ("adamw", "muon") if any(r["optimizer"] == opt for r in runs)}
    rec = result_record(binary, stamp, binary_commit=binary_commit(binary), cores=os.cpu_count(), threads=a.threads,
                        config=CONFIG, steps=a.steps, common_overrides=common_overrides(a),
                        val_every=a.val_every, val_batches=a.val_batches, note=a.note,
                        load_before=load_before, runs=runs,
                        winners={k: {"lr": v["lr"], "best_val_loss": v["best_val_loss"],
                                     "best_val_step": v["best_val_step"]} for k, v in best.items()})
    md = [f"# Muon + AdamW vs AdamW on shakespeare_char, CPU ({rec['date']})", "",
          machine_line(rec) + f"; binary built from {rec['binary_commit']} (load before: "
          f"{', '.join(f'{x:.1f}' for x in load_before)})",
          f"- {rec['cores']} logical CPUs, one process, OMP_NUM_THREADS={a.threads}",
          f"- config: {CONFIG} trained {a.steps} steps (the config's default is 2000), cosine decay over those "
          f"{a.steps} steps to lr / 10, 100 warmup steps; evaluation every {a.val_every} steps on the same "
          f"{a.val_batches} validation batches (x 12 x 64 tokens) in every run",
          "- AdamW: `--optimizer.args.lr LR --lr_scheduler.args.min_lr LR/10`; Muon: `--optimizer.type muon "
          f"--optimizer.args {{lr: LR}} --optimizer.adamw_args {ADAMW_ARGS}` (Muon's other keys at "
          "torch.optim.Muon's defaults; fp32 Newton-Schulz)",
          "- common overrides: `" + " ".join(common_overrides(a)) + "` (and `--run_dir` a temporary folder)",
          "- runs alternate between the optimizers; wall times are only as good as the machine was quiet"
          + (f"; note: {a.note}" if a.note else ""),
          *([f"- rows marked (earlier): the runs of {a.previous and pathlib.Path(a.previous).name}, same overrides, "
             "same binary"] if any(r.get("from_file") for r in runs) else []), "",
          "Final train loss: mean of the train losses logged (every 10 steps) in the last 100 steps. "
          "ms/step: median over logging intervals; optimizer ms: median `time_optimizer_ms` (clipping + step).", "",
          "| optimizer | lr | best val loss | at step | final val loss | final train loss | wall s | ms/step | "
          "optimizer ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(runs, key=lambda r: (r["optimizer"], r["lr"])):
        mark = "**" if r is best[r["optimizer"]] else ""
        md.append(f"| {'Muon + AdamW' if r['optimizer'] == 'muon' else 'AdamW'} | {r['lr']:g}"
                  f"{' (earlier)' if r.get('from_file') else ''} | "
                  f"{mark}{r['best_val_loss']:.4f}{mark} | {r['best_val_step']} | {r['final_val_loss']:.4f} | "
                  f"{r['final_train_loss']:.4f} | {r['wall_s']:.0f} | {r['ms_per_step']:.1f} | "
                  f"{r['optimizer_ms'] or 0:.2f} |")
    if len(best) < 2:
        write_result(a.out, "muon_shakespeare", stamp, rec, md + ["", "(partial: the sweep is still running)"])
        return
    ba, bm = best["adamw"], best["muon"]
    lrs = {k: sorted(r["lr"] for r in runs if r["optimizer"] == k) for k in best}
    edge = [k for k, v in best.items() if len(lrs[k]) > 1 and v["lr"] in (lrs[k][0], lrs[k][-1])]
    md += ["", f"Best AdamW: lr {ba['lr']:g}, val loss {ba['best_val_loss']:.4f} at step {ba['best_val_step']}. "
           f"Best Muon + AdamW: lr {bm['lr']:g}, val loss {bm['best_val_loss']:.4f} at step {bm['best_val_step']}. "
           f"Muon - AdamW: {bm['best_val_loss'] - ba['best_val_loss']:+.4f}."
           + (f" At the edge of its lr grid (not bracketed): {', '.join(edge)}." if edge else ""),
           "", "Validation curves (step: loss):", ""]
    for r in sorted(runs, key=lambda r: (r["optimizer"], r["lr"])):
        md.append(f"- {r['optimizer']} lr {r['lr']:g}: " + ", ".join(f"{s}: {v:.3f}" for s, v in r["val_curve"]))
    write_result(a.out, "muon_shakespeare", stamp, rec, md)


def main():
    a = parse_args(__doc__, more)
    binary = str(pathlib.Path(a.nnstrain).resolve())
    if not (DATA / "train.bin").is_file():
        sys.exit(f"{DATA}/train.bin is missing: run `{binary} prepare shakespeare_char` first")
    stamp = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    order = []  # alternate the optimizers, so a busy spell of the machine hits both
    for i in range(max(len(a.adamw_lrs), len(a.muon_lrs))):
        order += [("adamw", a.adamw_lrs[i])] if i < len(a.adamw_lrs) else []
        order += [("muon", a.muon_lrs[i])] if i < len(a.muon_lrs) else []
    runs = []
    if a.previous:
        prev = json.loads(pathlib.Path(a.previous).read_text())
        if prev["common_overrides"] != common_overrides(a):
            sys.exit(f"{a.previous} ran other common overrides: {prev['common_overrides']}")
        if prev["binary_commit"] != binary_commit(binary):
            sys.exit(f"{a.previous} ran a binary built from {prev['binary_commit']}, not {binary_commit(binary)}")
        runs = [dict(r, from_file=pathlib.Path(a.previous).name) for r in prev["runs"]]
    with tempfile.TemporaryDirectory() as t:
        def run(opt, lr):
            r = one_run(binary, a.threads, pathlib.Path(t) / f"run{len(runs)}_{opt}", opt, lr, a)
            runs.append(r)
            report(a, binary, stamp, load_before, runs)
            print(f"{opt:6s} lr {lr:<8g} best val {r['best_val_loss']:.4f} @ {r['best_val_step']}, final val "
                  f"{r['final_val_loss']:.4f}, final train {r['final_train_loss']:.4f}, {r['wall_s']:.0f} s, "
                  f"{r['ms_per_step']:.1f} ms/step (optimizer {r['optimizer_ms'] or 0:.2f} ms)", flush=True)

        for opt, lr in order:
            run(opt, lr)
        # A winner at the edge of its grid is not tuned: with --extend, one more lr beyond that edge
        # (x2 or /2), once per optimizer.
        for opt in ("adamw", "muon") if a.extend else ():
            mine = sorted((r for r in runs if r["optimizer"] == opt), key=lambda r: r["lr"])
            win = min(mine, key=lambda r: r["best_val_loss"])
            if len(mine) > 1 and win is mine[-1]:
                run(opt, win["lr"] * 2)
            elif len(mine) > 1 and win is mine[0]:
                run(opt, win["lr"] / 2)
    report(a, binary, stamp, load_before, runs)


if __name__ == "__main__":
    sys.exit(main())
