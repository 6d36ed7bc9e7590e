#!/usr/bin/env python3
"""Loss curves of an nnstrain run folder as a PNG: training and validation loss
against steps (left) and tokens seen (right), and, for a run of several ranks,
every rank's step time (compute and waiting) at the logged steps, with the
straggler named by fault_tolerance marked, and each in-training task score
(eval: records, eval_<task>/<metric>) against steps. Called by `nnstrain report`;
reads RUN_DIR/metrics.jsonl and, for the tokens axis, RUN_DIR/run.json.

    python scripts/plot_run.py RUN_DIR [--out PNG]
"""
import argparse
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path)
    a = ap.parse_args()
    out = a.out or a.run_dir / "loss_curves.png"

    train, val, ranks, scores = [], [], [], {}
    for line in (a.run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "rank_compute_ms" in rec:
                ranks.append((rec["step"], rec["rank_compute_ms"], rec["rank_wait_ms"], rec.get("straggler")))
            if "eval_seconds" in rec:
                for k, v in rec.items():
                    if k.startswith("eval_") and k != "eval_seconds" and isinstance(v, (int, float)):
                        scores.setdefault(k[5:], []).append((rec["step"], v))
                continue
            if "val_loss" in rec:
                val.append((rec["step"], rec["val_loss"]))
            elif "loss" in rec:
                train.append((rec["step"], rec["loss"]))
    if not train and not val and not scores:
        sys.exit(f"{a.run_dir}/metrics.jsonl: no loss records to plot")
    run_json = a.run_dir / "run.json"
    tokens_per_step = json.loads(run_json.read_text()).get("tokens_per_step", 0) if run_json.exists() else 0

    axes_x = [("step", 1)] + ([("tokens", tokens_per_step)] if tokens_per_step else [])
    panels = len(axes_x) + (2 if ranks else 0) + len(scores)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2), squeeze=False)
    if ranks:
        plot_rank_times(axes[0][len(axes_x)], axes[0][len(axes_x) + 1], ranks)
    first_score = len(axes_x) + (2 if ranks else 0)
    for ax, (name, points) in zip(axes[0][first_score:], sorted(scores.items())):
        ax.plot([s for s, _ in points], [v for _, v in points], "o-", lw=1.5, ms=3)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.set_title(f"eval {name}")
        ax.grid(alpha=0.3)
    for ax, (label, scale) in zip(axes[0], axes_x):
        if train:
            ax.plot([s * scale for s, _ in train], [v for _, v in train], label="train", lw=1.2)
        if val:
            ax.plot([s * scale for s, _ in val], [v for _, v in val], "o-", label="val", lw=1.5, ms=3)
        ax.set_xlabel(label)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"nnstrain run {a.run_dir.resolve().name}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def plot_rank_times(compute_ax, wait_ax, ranks):
    """Each rank's compute and waiting time per logged step; a named straggler's point ringed."""
    steps = [s for s, _, _, _ in ranks]
    for col, (ax, title) in enumerate(((compute_ax, "compute ms"), (wait_ax, "waiting ms"))):
        for r in range(len(ranks[0][1])):
            ax.plot(steps, [rec[1 + col][r] for rec in ranks], lw=1, label=f"rank {r}")
        for s, compute, wait, straggler in ranks:
            if straggler:
                r = straggler["rank"]
                ax.plot([s], [(compute, wait)[col][r]], "o", mfc="none", mec="red", ms=9)
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if len(ranks[0][1]) <= 16:
            ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
