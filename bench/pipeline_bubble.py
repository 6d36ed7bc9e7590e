"""Pipeline bubble, measured against the schedule simulator's prediction.

Each schedule runs 4 pipeline ranks (`nnstrain launch`, Gloo on CPU) of an
8-layer Llama in the synthetic-cost mode (NNSTRAIN_PIPELINE_SYNTHETIC_MS: every
F, I and W waits its time per layer instead of computing, transfers are real),
8 micro-batches per step, each schedule with and without optimizer
post-validation (pas_config.pipeline_post_validation: consecutive steps may
overlap). Each rank logs, per step, when it started, when its last action ended
and how long it was busy. Over a window of steady-state steps (the first two and
the last two left out: the first warms up, the last is logged, so synchronous)
a rank's idle fraction is 1 - its busy time / the window's span, whole
periods from the last rank's end of the step before the window to its end of
the window's last (a step's start is no common mark once steps overlap): what
the steps cost beyond the pipeline's compute, the optimizer and the steps'
synchronisation included.
The baseline is the simulator (trainer/pipeline/schedule.h) run on the
same lists with the same costs (pipeline::simulate_steady: consecutive steps,
synchronous or overlapping), logged by the run itself, and the published
formula: GPipe and 1F1B (p-1)/(m+p-1) = 27.3% at p 4, m 8; interleaved
(p-1)/(v m+p-1) = 15.8% at v 2; ZB-H1 (zb1p) (p-1)(F+I-W) idle per rank,
(p-1)/(3m+p-1) = 11.1% at F = I = W; and for zbv the V's lower bound (the
last rank waits p-1 half-stage forwards): (p-1)/(6m+p-1) = 5.9% at m 8, so
zbv also runs at m 16 (3.0%), where below 5% is possible.

  /root/.cache/nnstrain/venv/bin/python bench/pipeline_bubble.py --nnstrain build/nnstrain
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

from bench_common import ROOT, cpu_model, git_commit, libtorch_version

CASES = [  # scheduler, stages, micro-batches, the formula's bubble
    ("gpipe", 4, 8, 3 / 11),
    ("1f1b", 4, 8, 3 / 11),
    ("1f1b_interleaved", 8, 8, 3 / 19),
    ("zb1p", 4, 8, 3 / 27),
    ("zbv", 8, 8, 3 / 51),
    ("zbv", 8, 16, 3 / 99),
]
RANKS, LAYERS = 4, 8


def tokens_file(folder):
    import numpy as np
    path = pathlib.Path(folder) / "tokens.bin"
    np.random.default_rng(0).integers(0, 64, 20000).astype("<u2").tofile(path)
    return path


def run_case(binary, scheduler, stages, micros, ms, steps, folder, post_validation):
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    run_dir = pathlib.Path(folder) / f"{scheduler}_m{micros}_pv{int(post_validation)}"
    args = [binary, "launch", "--nproc-per-node", str(RANKS), "--",
            "--config", ROOT / "tests/integration/configs/tiny_dp.yaml", "--run_dir", run_dir,
            "--vars.data", tokens_file(folder), "--compute_config.device", "cpu",
            "--model.type", "llama", "--model.args",
            "{vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: %d, num_attention_heads: 4, "
            "num_key_value_heads: 2, max_position_embeddings: 32}" % LAYERS,
            "--micro_batch_size", "1", "--global_batch_size", str(micros), "--max_train_steps", str(steps),
            "--compute_config.pas_config.pp_size", str(RANKS),
            "--compute_config.pas_config.pipeline_nstages", str(stages),
            "--compute_config.pas_config.pipeline_scheduler", scheduler,
            "--compute_config.pas_config.pipeline_post_validation", str(post_validation).lower(),
            "--optimizer.clip_gnorm", "0",  # no rollbacks: the steady state, not the redo, is measured
            "--log_progress_every_n_train_steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", NNSTRAIN_PIPELINE_SYNTHETIC_MS=f"{ms},{ms},{ms}")
    p = subprocess.run([str(a) for a in args], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{scheduler} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    timeline, predicted = {}, None
    for r in range(RANKS):
        log = (run_dir / "logs" / f"rank{r}.log").read_text()
        timeline[r] = [tuple(int(v) for v in m) for m in
                       re.findall(r"pipeline synthetic step: pipeline rank \d+ start_ns (\d+) end_ns (\d+) busy_ns (\d+)", log)]
        m = re.search(r"simulated bubble per pipeline rank: ([0-9. ]+)", log)
        if m:
            predicted = [float(v) for v in m.group(1).split()]
    # The window: steady-state steps first..last (0-based), whole periods: from
    # the end of the step before it (its last rank's) to the end of its last.
    first, last = 2, steps - 3
    span = max(timeline[r][last][1] for r in range(RANKS)) - max(timeline[r][first - 1][1] for r in range(RANKS))
    measured = [1 - sum(timeline[r][k][2] for k in range(first, last + 1)) / span for r in range(RANKS)]
    if post_validation:
        assert "0 rolled back" in (run_dir / "logs" / "rank0.log").read_text(), "a step was rolled back"
    return measured, predicted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"))
    ap.add_argument("--ms", type=float, default=20.0, help="milliseconds per layer of each F, I and W")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--baseline", help="another nnstrain binary (the one before a change): each case runs it too, "
                                       "right before this one, so both see the same machine")
    ap.add_argument("--only", help="comma-separated schedulers to run (default: every case)")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for scheduler, stages, micros, published in CASES:
            if only and scheduler not in only:
                continue
            for pv in (False, True):
                base = None
                if a.baseline:
                    base, _ = run_case(a.baseline, scheduler, stages, micros, a.ms, a.steps,
                                       pathlib.Path(tmp) / "baseline", pv)
                measured, predicted = run_case(a.nnstrain, scheduler, stages, micros, a.ms, a.steps, tmp, pv)
                rows.append({"scheduler": scheduler, "pp": RANKS, "stages": stages, "micros": micros,
                             "post_validation": pv, "measured": measured, "simulated": predicted,
                             "published": published, "baseline": base})
                print(scheduler, micros, "post-validation" if pv else "synchronous", "measured",
                      [f"{m:.3f}" for m in measured], "simulated", predicted,
                      *(["baseline", [f"{m:.3f}" for m in base]] if base else []), flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"date": now.isoformat(timespec="seconds"), "device": "cpu: " + cpu_model(),
            "libtorch": libtorch_version(a.nnstrain), "commit": git_commit(), "load_average": os.getloadavg(),
            "ms_per_layer": a.ms, "steps_timed": a.steps - 4, "layers": LAYERS, "baseline": a.baseline,
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    stem = ROOT / "bench" / "results" / f"pipeline_bubble_{now.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    pct = lambda v: f"{100 * v:.1f}%"
    lines = [f"# Pipeline bubble, measured vs simulated ({meta['date']})", "",
             f"{meta['device']}, LibTorch {meta['libtorch']}, commit {meta['commit']}, load average "
             f"{' '.join(f'{x:.1f}' for x in meta['load_average'])}. {RANKS} pipeline ranks (Gloo, one machine), "
             f"an {LAYERS}-layer model, F = I = W = {a.ms:g} ms per layer "
             f"(synthetic costs: waits, not compute), over a window of {a.steps - 4} consecutive steps of {a.steps} "
             f"(the first two and the last two left out). uptime before: {meta['uptime']}", "",
             *([f"Baseline: {a.baseline}, each case run right before this binary's.", ""] if a.baseline else []),
             "| schedule | stages | micro-batches | post-validation | idle per rank, measured | mean | "
             "simulated per rank | mean | formula |" + (" baseline mean |" if a.baseline else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if a.baseline else "")]
    for r in rows:
        mean = lambda v: sum(v) / len(v)
        lines.append(f"| {r['scheduler']} | {r['stages']} | {r['micros']} | {'on' if r['post_validation'] else 'off'} | "
                     f"{' '.join(pct(v) for v in r['measured'])} | "
                     f"{pct(mean(r['measured']))} | {' '.join(pct(v) for v in r['simulated'])} | "
                     f"{pct(mean(r['simulated']))} | {pct(r['published']) if r['published'] else '-'} |" +
                     (f" {pct(mean(r['baseline']))} |" if r["baseline"] else ""))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("wrote", stem.with_suffix(".md"))


if __name__ == "__main__":
    main()
