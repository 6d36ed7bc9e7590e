#!/usr/bin/env python3
"""Memory per pipeline rank before and after freeing sent tensors at their delivery (issue 21).

The pipeline executor used to keep every tensor it sent until the step's
end; it now drops each once a receive proves it delivered
(pipeline::retired_sends), and the cost model counts the same. This runs
bench_pipeline_memory.py's runs (the same GPT, 8 micro-batches per step,
every scheduler at pp 2 and 4, and 1f1b, zb1p and zbv at pp 4 with every
layer recomputed) with two binaries in the same session: --before (built at
the base commit) and --nnstrain (after). Per pipeline rank: the largest
`peak_tensor_mb_per_pp_rank` over the steps and plan.json's
`estimate.pp_rank_bytes`, for both; and whether every step's loss and
gradient norm are bitwise equal between the two (freeing memory must not
change a number).

  ~/.cache/nnstrain/venv/bin/python bench/bench_pipeline_sends.py --before /tmp/nnstrain_before --nnstrain build/nnstrain

Writes bench/results/pipeline_sends_<UTC time>.json and .md.
"""
import datetime
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import libtorch_version, machine_line, parse_args, random_tokens, result_record, write_result  # noqa: E402
from bench_pipeline_memory import GOAL, RECOMPUTED, SCHEDULERS, VOCAB, run  # noqa: E402


def steps_of(run_dir):
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [(r["loss"], r["grad_norm"]) for r in recs if "peak_tensor_mb" in r]


def main():
    a = parse_args(__doc__, lambda ap: ap.add_argument("--before", required=True, help="nnstrain at the base commit"))
    stamp = datetime.datetime.now(datetime.timezone.utc)
    cases = [(s, pp, False) for pp in (2, 4) for s in SCHEDULERS] + [(s, 4, True) for s in RECOMPUTED]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        tmp = pathlib.Path(work)
        data = random_tokens(tmp / "tokens.bin", VOCAB, 200_000)
        for scheduler, pp, recompute in cases:
            row = {}
            for label, binary in (("before", a.before), ("after", a.nnstrain)):
                d = tmp / label
                d.mkdir(exist_ok=True)
                row[label] = run(binary, data, d, scheduler, pp, recompute)
                name = f"{scheduler}_pp{pp}" + ("_recompute" if recompute else "")
                row[label]["steps"] = steps_of(d / name)
            row["bitwise"] = row["before"]["steps"] == row["after"]["steps"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    worst = max(abs(e) for r in rows for e in r["after"]["error"])
    worst_before = max(abs(e) for r in rows for e in r["before"]["error"])
    out = result_record(a.nnstrain, stamp, rows=rows, worst_error=worst, worst_error_before=worst_before, goal=GOAL,
                        libtorch_before=libtorch_version(a.before),
                        model="as bench_pipeline_memory.py: GPT 8 x 128, 4 heads, vocab 64, tied; 8 micro-batches "
                              "of 2 x 256 tokens per step, 3 steps; fp32, no ZeRO, pas_policy dp")
    lines = [f"# Pipeline sends freed at delivery: memory per pipeline rank before and after, CPU "
             f"({stamp:%Y-%m-%d %H:%M} UTC)", "",
             machine_line(out) + " (after); before: the base commit's binary, run in the same session",
             f"- model: {out['model']}; Gloo, OMP_NUM_THREADS=1 per rank",
             "- measured = the rank's largest `peak_tensor_mb_per_pp_rank` over the steps; estimate = plan.json "
             "`estimate.pp_rank_bytes`; error = measured / estimate - 1",
             f"- goal: every rank within {100 * GOAL:.0f}% of its estimate; worst after {100 * worst:.1f}%, "
             f"before {100 * worst_before:.1f}%",
             f"- every step's loss and gradient norm bitwise equal before and after: "
             f"{'yes, in every run' if all(r['bitwise'] for r in rows) else 'NO'}", "",
             "| scheduler | pp | recomputed layers | pipeline rank | measured before | measured after | change | "
             "estimate before | estimate after | error before | error after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b, f = r["before"], r["after"]
        for k in range(f["pp"]):
            flag = "" if abs(f["error"][k]) <= GOAL else " **over**"
            lines.append(f"| {f['scheduler']} | {f['pp']} | {f['recompute']} | {k} | {b['measured_mib'][k]:.2f} MiB | "
                         f"{f['measured_mib'][k]:.2f} MiB | {f['measured_mib'][k] - b['measured_mib'][k]:+.2f} MiB | "
                         f"{b['estimate_mib'][k]:.2f} MiB | {f['estimate_mib'][k]:.2f} MiB | "
                         f"{100 * b['error'][k]:+.1f}% | {100 * f['error'][k]:+.1f}%{flag} |")
    write_result(a.out, "pipeline_sends", stamp, out, lines)


if __name__ == "__main__":
    main()
