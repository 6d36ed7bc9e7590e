#!/usr/bin/env python3
"""What logging and profiling cost, in tokens/s, on CPU.

Trains configs/shakespeare_char_cpu.yaml (GPT n_layer 4, n_embd 128, block 64,
batch 12) for 200 steps, no evaluation, no checkpoints, under these settings:

  quiet       a progress line every 30 steps, console only (no JSONL, no TensorBoard):
              the baseline, as close to "no logging" as the loop gets
  default     the defaults: console + metrics.jsonl + TensorBoard every 10 steps,
              each with the step-time split (what a user gets out of the box)
  every_step  console + JSONL + TensorBoard and the split at every step
  profiling   the defaults plus the profiler recording steps 31..190
  reference   (with --reference BINARY) another nnstrain binary, e.g. one built from
              the commit before these features, with the quiet settings: the cost of
              the instrumentation that stays in the loop (timer, profiler ranges)

Two measures. Wall: the wall time between the progress lines of steps 30 and 180 (their
timestamps, ms resolution), so everything the loop does in between counts:
the logging syncs, formatting, file writes, the profiler's recording (its trace
is written at step 190, outside the span). tokens/s = 150 steps x 768 tokens /
that time. CPU: 200 steps x 768 tokens / the process's user + system CPU time
(startup included, the same for every setting), which other processes on a
shared machine disturb far less than wall time. The settings alternate within
each repeat; medians over repeats are reported, with the wall figure's min and max.

Writes bench/results/observability_cpu_<UTC time>.json and .md with the device,
date, LibTorch version, git commit, threads and load average.

Usage (repository root, after `nnstrain prepare shakespeare_char`):
  ~/.cache/nnstrain/venv/bin/python bench/bench_observability_cpu.py --nnstrain build/nnstrain --repeats 3
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_common import run_single  # noqa: E402
CONFIG = "configs/shakespeare_char_cpu.yaml"
STEPS, FROM, TO = 200, 30, 180
TOKENS_PER_STEP = 12 * 64

SETTINGS = {
    "quiet": ["--log_progress_every_n_train_steps", "30", "--log", "[{type: console}]"],
    "default": ["--log_progress_every_n_train_steps", "10"],
    "every_step": ["--log_progress_every_n_train_steps", "1"],
    "profiling": ["--log_progress_every_n_train_steps", "10", "--profile.steps", "[31, 190]"],
}
LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})\] .*?step (\d+)/\d+: loss", re.M)


def run(binary, extra, threads, data_dir, tries=3):
    """(tokens/s over the timed steps, tokens per CPU second of the whole process); a run
    stopped by a stray SIGTERM (a shared machine) is run again."""
    for _ in range(tries):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = run_once(binary, extra, threads, data_dir)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if "stopped early on request" not in out:
            break
        print("  (stopped by a signal from elsewhere: running it again)", flush=True)
    else:
        sys.exit("every try was stopped by a signal")
    stamps = {int(s): datetime.datetime.strptime(t, "%Y-%m-%d %H:%M:%S.%f") for t, s in LINE.findall(out)}
    if FROM not in stamps or TO not in stamps:
        sys.exit(f"no progress lines for steps {FROM} and {TO}:\n{out[-2000:]}")
    secs = (stamps[TO] - stamps[FROM]).total_seconds()
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return (TO - FROM) * TOKENS_PER_STEP / secs, STEPS * TOKENS_PER_STEP / cpu


def run_once(binary, extra, threads, data_dir):
    with tempfile.TemporaryDirectory(prefix="nnstrain_obs_bench_") as tmp:
        args = [binary, "--config", CONFIG, "--run_dir", tmp, "--max_train_steps", str(STEPS),
                "--val_every_n_train_steps", "0", "--checkpoint.save_dir=", "--checkpoint.every_n_train_steps", "0",
                "--vars.data_dir", str(data_dir), *extra]
        p = run_single(args, threads)
        out = p.stdout + p.stderr
        stopped = "stopped early on request" in out
        if "--profile.steps" in extra and not stopped and not (pathlib.Path(tmp) / "profile" / "trace_rank0.json").is_file():
            sys.exit("the profiling run wrote no trace")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nnstrain", default="build/nnstrain")
    ap.add_argument("--reference", help="another nnstrain binary, run with the quiet settings")
    ap.add_argument("--reference-commit", default="", help="the commit the reference binary was built from")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=str(ROOT / "data" / "shakespeare_char"))
    ap.add_argument("--note", default="")
    a = ap.parse_args()

    settings = dict(SETTINGS)
    binaries = {name: a.nnstrain for name in settings}
    if a.reference:
        settings["reference"] = SETTINGS["quiet"]
        binaries["reference"] = a.reference
    load_before = os.getloadavg()
    results = {name: [] for name in settings}
    cpu_results = {name: [] for name in settings}
    for r in range(a.repeats):
        for name, extra in settings.items():
            tps, cpu_tps = run(binaries[name], extra, a.threads, a.data_dir)
            results[name].append(tps)
            cpu_results[name].append(cpu_tps)
            print(f"repeat {r + 1}: {name:10s} {tps:8.0f} tok/s wall, {cpu_tps:8.0f} tok per CPU-s", flush=True)
    load_after = os.getloadavg()

    base = statistics.median(results["quiet"])
    cpu_base = statistics.median(cpu_results["quiet"])
    rows = []
    for name, xs in results.items():
        med, cxs = statistics.median(xs), cpu_results[name]
        cmed = statistics.median(cxs)
        # Paired: each repeat's setting against that repeat's quiet run (load drifts between repeats).
        paired = statistics.median(100 * (1 - c / q) for c, q in zip(cxs, cpu_results["quiet"]))
        rows.append({"setting": name, "median_tokens_per_s": med, "min": min(xs), "max": max(xs), "runs": xs,
                     "overhead_vs_quiet_pct": 100 * (base - med) / base,
                     "median_tokens_per_cpu_s": cmed, "cpu_runs": cxs,
                     "cpu_overhead_vs_quiet_pct": 100 * (cpu_base - cmed) / cpu_base,
                     "cpu_overhead_paired_median_pct": paired})

    import torch
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"date": now.isoformat(timespec="seconds"), "device": f"{cpu} ({os.cpu_count()} logical CPUs)",
            "libtorch": torch.__version__, "commit": commit, "threads": a.threads, "repeats": a.repeats,
            "config": CONFIG, "steps": STEPS, "timed_steps": f"{FROM + 1}..{TO}",
            "load_avg_before": load_before, "load_avg_after": load_after, "note": a.note,
            "reference": {"binary": a.reference, "commit": a.reference_commit} if a.reference else None}
    out = ROOT / "bench" / "results" / f"observability_cpu_{now.strftime('%Y%m%d-%H%M%S')}"
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    md = [f"# Logging and profiling overhead on CPU ({meta['date']})", "",
          f"- device: {meta['device']}, {a.threads} thread(s)",
          f"- LibTorch {meta['libtorch']}, commit {commit}",
          f"- {CONFIG}, {STEPS} steps, tokens/s over steps {FROM + 1}..{TO} from the progress lines' timestamps; "
          f"median of {a.repeats} alternating repeats",
          f"- load average (1/5/15 min) before {load_before}, after {load_after}"]
    if a.reference:
        md.append(f"- reference: {a.reference} (commit {a.reference_commit or 'unknown'}) with the quiet settings")
    if a.note:
        md.append(f"- note: {a.note}")
    md += ["", "Wall: tokens/s of the timed steps (what a user sees; at the mercy of other processes). "
           "CPU: tokens per CPU-second of the whole process, startup included (steadier on a shared machine; "
           "the profiler's trace write counts here). Overhead > 0: slower than quiet. Paired: the median over "
           "repeats of each repeat's CPU figure against the same repeat's quiet run.", "",
           "| setting | wall tok/s (median) | min | max | wall overhead | tok per CPU-s (median) | CPU overhead | "
           "CPU overhead, paired |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        md.append(f"| {row['setting']} | {row['median_tokens_per_s']:.0f} | {row['min']:.0f} | {row['max']:.0f} | "
                  f"{row['overhead_vs_quiet_pct']:+.2f}% | {row['median_tokens_per_cpu_s']:.0f} | "
                  f"{row['cpu_overhead_vs_quiet_pct']:+.2f}% | {row['cpu_overhead_paired_median_pct']:+.2f}% |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"\nwrote {out}.json and .md")


if __name__ == "__main__":
    main()
