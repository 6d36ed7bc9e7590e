#!/usr/bin/env python3
"""A PNG timeline of a Chrome-trace JSON (what `profile:` writes), for a quick
look without a browser: one row per range level on the main thread, the
ProfilerStep#N and data/forward/backward/communication/optimizer ranges on top,
the operators they call below. Perfetto (https://ui.perfetto.dev) remains the
viewer to use; this is a picture of the same data.

    python scripts/trace_timeline.py RUN_DIR/profile/trace_rank0.json --out timeline.png [--depth 3]
"""
import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PARTS = {"data": "#8c8c8c", "forward": "#4c78a8", "backward": "#e45756", "communication": "#b279a2",
         "optimizer": "#54a24b"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--depth", type=int, default=3, help="rows of nested operators to draw")
    a = ap.parse_args()

    events = [e for e in json.loads(a.trace.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise SystemExit(f"{a.trace}: no ProfilerStep ranges")
    tid = steps[0]["tid"]
    t0 = min(e["ts"] for e in steps)
    on_thread = sorted((e for e in events if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"]))
    # Nesting level from containment: a stack of open ranges.
    rows, stack = [], []
    for e in on_thread:
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        rows.append((len(stack), e))
        stack.append(e)
    depth = 2 + a.depth  # step, part, then operators
    span_ms = (max(e["ts"] + e["dur"] for e in steps) - t0) / 1000
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * depth))
    for level, e in rows:
        if level >= depth:
            continue
        x, w = (e["ts"] - t0) / 1000, e["dur"] / 1000
        color = "#f2cf5b" if level == 0 else PARTS.get(e["name"], "#bab0ac")
        ax.barh(-level, w, left=x, height=0.8, color=color, edgecolor="white", linewidth=0.3)
        label = e["name"].replace("autograd::engine::evaluate_function: ", "").replace("aten::", "")
        if w > span_ms * 0.004 * len(label):  # room for the text (about 0.4% of the width per character)
            ax.text(x + w / 2, -level, label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks([-i for i in range(depth)])
    ax.set_yticklabels(["step", "part"] + [f"op level {i + 1}" for i in range(depth - 2)])
    ax.set_xlabel("ms from the first profiled step")
    ax.set_title(f"{a.trace.name}: {len(steps)} profiled step(s), main thread")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
