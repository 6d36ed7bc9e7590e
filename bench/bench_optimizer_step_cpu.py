#!/usr/bin/env python3
"""The optimizer step alone on CPU, Muon + AdamW against AdamW, on GPT-2 124M
(configs/gpt2_124m.yaml's model): nnstrain and PyTorch's own optimizers.

- **nnstrain**: one process, `--config configs/gpt2_124m.yaml` with its model
  as written (12 x 12 x 768, vocabulary 50304, block 1024 positions) and a
  small batch so forward and backward stay short: one sequence of --seq
  tokens (`--vars.block_size` also sizes the position embedding: --seq rows
  instead of 1024, 0.6% of the parameters), 32-true (the optimizer works on
  fp32 weights under every precision; CPU autocast would only slow the rest),
  no clipping (so the timed part is the step alone), synthetic tokens. Each
  step is logged (`--log_progress_every_n_train_steps 1`); the figure is
  `time_optimizer_ms` of metrics.jsonl (docs/observability.md: gradient norm,
  clipping, the step; on CPU from the host clock) over the steps after
  --warmup. Rows: AdamW (the config's keys, `impl: auto`), Muon (the config's
  AdamW keys as `adamw_args`, Muon lr 0.02, fp32 Newton-Schulz: `ns_dtype:
  auto` on the CPU) and, with --bf16, Muon with `ns_dtype: bf16` (what CUDA
  runs and what torch.optim.Muon always does). Which optimizer ran is read
  from the run's active/rank0.json.
- **Baseline, PyTorch** (in the same run, the same thread count;
  bench/optimizer_step_reference.py): parameters of the same shapes with
  random gradients; `torch.optim.AdamW(fused=True)` over all of them, and
  `torch.optim.Muon` (its defaults, lr 0.02; it casts to bf16 for
  Newton-Schulz) over the 48 block matrices plus `torch.optim.AdamW(fused=True)`
  over the rest; wall time of `step()`.
- The rows alternate within each of --repeats rounds (nnstrain AdamW, nnstrain
  Muon, [bf16 Muon], PyTorch), so a busy spell of a shared machine falls on
  all; reported: median and minimum over every timed step of every round.

Results: bench/results/optimizer_step_<UTC time>.{json,md}.

Usage (from the repository root):
  ~/.cache/nnstrain/venv/bin/python bench/bench_optimizer_step_cpu.py [--threads 1] [--steps 3] [--warmup 2] [--repeats 2]
"""
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import (ROOT, binary_commit, machine_line, parse_args, random_tokens,  # noqa: E402
                          result_record, run_single, write_result)

CONFIG = "configs/gpt2_124m.yaml"
ADAMW_ARGS = "{lr: 6.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1}"  # the config's
MUON_LR = 0.02
# --smoke: a tiny GPT instead of 124M, to check the plumbing in seconds (nnstrain overrides, reference flags).
SMOKE = (["--model.args.n_layer", "2", "--model.args.n_head", "2", "--model.args.n_embd", "64",
          "--model.args.vocab_size", "512"], ["--n-layer", "2", "--n-embd", "64", "--vocab-size", "512"])

def nnstrain_overrides(data, seq, steps, case, smoke):
    o = (SMOKE[0] if smoke else []) + [
        "--compute_config.device", "cpu", "--precision", "32-true", "--vars.data_dir", str(data),
        "--vars.block_size", str(seq), "--micro_batch_size", "1", "--global_batch_size", "1",
        "--max_train_steps", str(steps), "--log_progress_every_n_train_steps", "1",
        "--val_every_n_train_steps", "0", "--checkpoint.every_n_train_steps", "0", "--optimizer.clip_gnorm", "0"]
    if case == "adamw":
        return o
    muon = f"{{lr: {MUON_LR:g}" + (", ns_dtype: bf16}" if case == "muon_bf16" else "}")
    return o + ["--optimizer.type", "muon", "--optimizer.args", muon, "--optimizer.adamw_args", ADAMW_ARGS]


def run_nnstrain(binary, threads, run_dir, data, seq, steps, warmup, case, smoke):
    args = [binary, "--config", CONFIG, "--run_dir", str(run_dir), *nnstrain_overrides(data, seq, steps, case, smoke)]
    run_single(args, threads)
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    opt = json.loads((run_dir / "active" / "rank0.json").read_text()).get("optimizer") or {}
    if ("momentum_buffer" in opt.get("state_segments", {})) != (case != "adamw"):
        sys.exit(f"{run_dir}: asked for {case}, active/rank0.json records {opt}")
    timed = [r for r in recs if r["step"] > warmup]
    return {"optimizer_ms": [r["time_optimizer_ms"] for r in timed],
            "step_ms": [r["ms_per_step"] for r in timed],
            "forward_backward_ms": [r.get("time_forward_ms", 0) + r.get("time_backward_ms", 0) for r in timed],
            "impl": opt.get("impl"), "overrides": args[5:]}  # after --run_dir


def run_reference(py, threads, seq, steps, warmup, smoke):
    """bench/optimizer_step_reference.py on the CPU: {case: {"ms": [...], ...}}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    p = subprocess.run([py, str(ROOT / "bench" / "optimizer_step_reference.py"), "--device", "cpu", "--threads",
                        str(threads), "--seq", str(seq), "--lr", str(MUON_LR), "--steps", str(steps), "--warmup",
                        str(warmup), *(SMOKE[1] if smoke else [])], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"the PyTorch reference failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return {r["case"]: r for r in map(json.loads, p.stdout.splitlines())}


def more(ap):
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64, help="tokens of the one sequence per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of alternating runs")
    ap.add_argument("--smoke", action="store_true", help="a tiny GPT, to check the plumbing (the figures mean nothing)")
    ap.add_argument("--bf16", action="store_true", help="also nnstrain's Muon with ns_dtype: bf16")
    ap.add_argument("--python", default=sys.executable, help="Python with torch for the reference")
    ap.add_argument("--note", default="", help="a remark stored with the figures (e.g. the machine was shared)")


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "n": len(xs)} if xs else None


def main():
    a = parse_args(__doc__, more)
    binary = str(pathlib.Path(a.nnstrain).resolve())
    stamp = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    cases = ["adamw", "muon"] + (["muon_bf16"] if a.bf16 else [])
    got = {c: {"optimizer_ms": [], "step_ms": [], "forward_backward_ms": []} for c in cases}
    ref = {"adamw": [], "muon": [], "adamw + norm": []}
    with tempfile.TemporaryDirectory() as t:
        data = pathlib.Path(t) / "data"
        data.mkdir()
        for split in ("train", "val"):
            random_tokens(data / f"{split}.bin", 512 if a.smoke else 50257, 200_000)
        for rnd in range(a.repeats):
            for c in cases:
                r = run_nnstrain(binary, a.threads, pathlib.Path(t) / f"{c}_{rnd}", data, a.seq,
                                 a.warmup + a.steps, a.warmup, c, a.smoke)
                for k in ("optimizer_ms", "step_ms", "forward_backward_ms"):
                    got[c][k] += r[k]
                got[c].update(impl=r["impl"], overrides=r["overrides"])
                print(f"round {rnd} nnstrain {c}: optimizer ms {', '.join(f'{x:.1f}' for x in r['optimizer_ms'])} "
                      f"({r['impl']})", flush=True)
            rr = run_reference(a.python, a.threads, a.seq, a.steps, a.warmup, a.smoke)
            for c in ("adamw", "muon"):
                ref[c] += rr[c]["ms"]
                print(f"round {rnd} pytorch {c}: step ms {', '.join(f'{x:.1f}' for x in rr[c]['ms'])}", flush=True)
            # Like nnstrain's figure: the global gradient norm, then the step (the same iterations).
            ref["adamw + norm"] += [n + m for n, m in zip(rr["adamw"]["norm_ms"], rr["adamw"]["ms"])]
            torch_version, n_params, n_muon = rr["adamw"]["torch"], rr["adamw"]["params"], rr["adamw"]["muon_params"]
    rows = {f"nnstrain {c}": {**summary(got[c]["optimizer_ms"]), "impl": got[c]["impl"],
                              "step_ms_median": statistics.median(got[c]["step_ms"]),
                              "forward_backward_ms_median": statistics.median(got[c]["forward_backward_ms"]),
                              "all_ms": got[c]["optimizer_ms"]} for c in cases}
    rows.update({f"pytorch {c}": {**summary(ref[c]), "all_ms": ref[c]} for c in ref})
    rec = result_record(binary, stamp, binary_commit=binary_commit(binary), cores=os.cpu_count(), threads=a.threads,
                        smoke=a.smoke, torch=torch_version, seq=a.seq,
                        steps=a.steps, warmup=a.warmup, repeats=a.repeats, params=n_params, muon_params=n_muon,
                        note=a.note, load_before=load_before, rows=rows,
                        overrides={c: got[c]["overrides"] for c in cases})
    ratio = rows["nnstrain muon"]["median"] / rows["nnstrain adamw"]["median"]
    md = [f"# Optimizer step on CPU: Muon + AdamW vs AdamW, GPT-2 124M ({rec['date']})", "",
          machine_line(rec) + f"; binary built from {rec['binary_commit']} (load before: "
          f"{', '.join(f'{x:.1f}' for x in load_before)}); torch (reference) {torch_version}",
          f"- {rec['cores']} logical CPUs, one process, {a.threads} thread(s)" + (f"; note: {a.note}" if a.note else ""),
          *(["- **SMOKE**: a tiny GPT (2 x 2 x 64, vocabulary 512); the figures mean nothing"] if a.smoke else []),
          f"- model: {CONFIG}'s GPT (12 x 12 x 768, vocabulary 50304), position table of {a.seq} rows: "
          f"{n_params / 1e6:.1f}M parameters, {n_muon / 1e6:.1f}M of them in the 48 block matrices Muon takes",
          f"- nnstrain: one sequence of {a.seq} tokens per step, 32-true, no clipping; {a.warmup} untimed steps then "
          f"{a.steps} timed per run, {a.repeats} rounds alternating the rows; figure = `time_optimizer_ms` "
          "(metrics.jsonl) of every timed step",
          "- nnstrain overrides (AdamW): `" + " ".join(got["adamw"]["overrides"]) + "`; Muon adds `"
          + " ".join(got["muon"]["overrides"][len(got["adamw"]["overrides"]):]) + "`",
          f"- PyTorch: the same shapes with random gradients, `step()` wall time (`+ norm`: with the gradients' global norm before it); AdamW(fused=True) over all; "
          f"Muon(lr {MUON_LR:g}, its defaults: bf16 Newton-Schulz) over the block matrices + AdamW(fused=True) "
          "over the rest", "",
          "| row | optimizer step ms (median) | min | steps | nnstrain impl | nnstrain step ms (median) | "
          "forward + backward ms |", "|---|---:|---:|---:|---|---:|---:|"]
    for name, r in rows.items():
        md.append(f"| {name} | {r['median']:.1f} | {r['min']:.1f} | {r['n']} | {r.get('impl', '')} | "
                  f"{r['step_ms_median']:.1f} | {r['forward_backward_ms_median']:.1f} |" if "impl" in r else
                  f"| {name} | {r['median']:.1f} | {r['min']:.1f} | {r['n']} | | | |")
    md += ["", f"nnstrain Muon / nnstrain AdamW (medians): {ratio:.1f}x. nnstrain Muon / PyTorch Muon: "
           f"{rows['nnstrain muon']['median'] / rows['pytorch muon']['median']:.2f}; nnstrain AdamW / PyTorch AdamW: "
           f"{rows['nnstrain adamw']['median'] / rows['pytorch adamw']['median']:.2f} (< 1: nnstrain faster)."
           + (f" Like for like in bf16: nnstrain Muon (ns_dtype bf16) / PyTorch Muon: "
              f"{rows['nnstrain muon_bf16']['median'] / rows['pytorch muon']['median']:.2f}." if a.bf16 else "")
           + " nnstrain's figure also holds the global gradient norm (computed even without clipping, in fp64); "
           "`pytorch adamw + norm` adds PyTorch's (`get_total_norm`, fp32) to its `step()`: nnstrain AdamW / that: "
           f"{rows['nnstrain adamw']['median'] / rows['pytorch adamw + norm']['median']:.2f}."]
    write_result(a.out, "optimizer_step_smoke" if a.smoke else "optimizer_step", stamp, rec, md)


if __name__ == "__main__":
    sys.exit(main())
