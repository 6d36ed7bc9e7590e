#!/usr/bin/env python3
"""Data-parallel scaling on CPU: nnstrain dp=2 (two processes, one thread each,
`nnstrain launch`, Gloo) against dp=1 (one process, one thread), same global batch.

Model: configs/shakespeare_char_cpu.yaml (nanoGPT's shakespeare_char CPU GPT:
n_layer 4, n_head 4, n_embd 128, block 64, no bias, dropout 0, AdamW fused, clip 1.0).
Global batch --global-batch (default 24): dp=1 trains micro-batches of 24, dp=2 of 12
on each rank. Each run trains --warmup + --steps steps with a metrics record every
step; the first --warmup steps are not timed.

Reported per layout:
- tokens/s over the timed steps (rank 0's metrics.jsonl: tokens_per_s counts the
  whole job's tokens, global batch x seq_len per step) and the median step time;
- scaling efficiency = tokens/s(dp=2) / (2 x tokens/s(dp=1)): 1.0 is perfect scaling
  on two cores, 0.5 is no gain at all. On a shared machine two processes get a
  larger share of the cores than one, so it comes with each process's share of a
  core (CPU seconds / wall seconds, from /proc/<pid>/stat) and the load average;
- CPU-time efficiency = tokens per CPU second of dp=2 / of dp=1: the work data
  parallelism adds per token (communication, smaller matrix products), less
  sensitive than wall time to other processes on the machine (not immune: they
  share the caches);
- gradient traffic: bytes every rank hands the kernel per training step, measured
  from /proc/<pid>/io (wchar: write/writev bytes, which include Gloo's TCP sends;
  the ranks write no files between logging lines except rank 0's metrics line), over
  the timed steps, against the ring all-reduce theory 2(n-1)/n x gradient bytes
  (gradient bytes = parameters x 4: fp32 gradients; parameters counted from the
  model config and checked against rank 0's "model gpt: X M parameters ... N buckets"
  line, which also gives the bucket count);
- losses of dp=1 and dp=2 step by step (the same global batch gives the same
  losses: the largest relative difference is printed as a sanity check).

Writes bench/results/dp_cpu_<UTC time>.json and .md with the device, date, torch
and LibTorch versions, git commit and the load average around each run.

Usage (from the repository root, after `nnstrain prepare shakespeare_char`):
  /root/.cache/nnstrain/venv/bin/python bench/bench_dp_cpu.py --nnstrain build/nnstrain
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import cpu_model, git_commit, libtorch_version  # noqa: E402,F401  (bench_checkpoint and bench_async_save import them from here)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/shakespeare_char_cpu.yaml"
# configs/shakespeare_char_cpu.yaml's model, for the exact parameter count (check_log() compares).
MODEL = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, bias=False)


def gpt_parameters(vocab_size, block_size, n_layer, n_embd, bias, **_):
    """nanoGPT's GPT with a tied head: embeddings, per block 2 LayerNorms, qkv,
    attention projection, MLP up and down; a final LayerNorm."""
    c = n_embd
    ln = c * (2 if bias else 1)
    block = 2 * ln + (3 * c * c + (3 * c if bias else 0)) + (c * c + (c if bias else 0)) \
        + (4 * c * c + (4 * c if bias else 0)) + (4 * c * c + (c if bias else 0))
    return vocab_size * c + block_size * c + n_layer * block + ln


def children(pid):
    out = []
    try:
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def rank_of(pid):
    try:
        for kv in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if kv.startswith(b"RANK="):
                return int(kv[5:])
    except OSError:
        pass
    return None


def counters(pid):
    """Bytes the process wrote (write/writev, so Gloo's TCP sends; its receives use
    recv(), which /proc does not count) and the CPU seconds it used."""
    try:
        fields = dict(line.split(": ") for line in pathlib.Path(f"/proc/{pid}/io").read_text().splitlines())
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        utime, stime = (int(x) for x in stat[stat.rindex(")") + 2:].split()[11:13])
        return {"wchar": int(fields["wchar"]), "cpu_s": (utime + stime) / os.sysconf("SC_CLK_TCK")}
    except (OSError, KeyError, ValueError):
        return None


def last_step(metrics):
    if not metrics.exists():
        return 0
    steps = [json.loads(l).get("step", 0) for l in metrics.read_text().splitlines() if l.strip()]
    return max(steps, default=0)


def run(binary, nproc, micro, steps, warmup, data_dir, bucket_cap_mb):
    """One training run; returns per-step records, rank 0's output, and per-rank bytes
    written per step over the timed steps (sampled from /proc while it runs)."""
    total = warmup + steps
    with tempfile.TemporaryDirectory(prefix="nnstrain_bench_dp_") as tmp:
        metrics = pathlib.Path(tmp) / "metrics.jsonl"
        train = ["--config", CONFIG, "--run_dir", tmp, "--max_train_steps", str(total),
                 "--micro_batch_size", str(micro), "--grad_accumulation_steps", "1",
                 "--log_progress_every_n_train_steps", "1", "--val_every_n_train_steps", "0",
                 "--checkpoint.save_dir=", "--checkpoint.every_n_train_steps", "0",
                 "--optimizer.args.impl", "fused", "--vars.data_dir", str(data_dir)]
        if bucket_cap_mb:
            train += ["--compute_config.reducer_bucket_cap_mb", str(bucket_cap_mb)]
        args = [binary, *train] if nproc == 1 else [binary, "launch", "--nproc-per-node", str(nproc), "--", *train]
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env["OMP_NUM_THREADS"] = "1"
        log = open(pathlib.Path(tmp) / "out.log", "w+")
        p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        samples = {}  # "start"/"end" -> (step, {rank: counters})
        try:
            while p.poll() is None:
                s = last_step(metrics)
                key = "start" if s >= warmup and "start" not in samples else \
                      "end" if s >= total - 2 and "end" not in samples else None
                if key:
                    pids = {0: p.pid} if nproc == 1 else {rank_of(c): c for c in children(p.pid)}
                    got = {r: counters(pid) for r, pid in pids.items()}
                    samples[key] = (last_step(metrics) if key == "end" else s, got)
                time.sleep(0.005)
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()
        log.seek(0)
        output = log.read()
        log.close()
        if p.returncode != 0:
            sys.exit(f"nnstrain failed ({p.returncode}): {' '.join(args)}\n{output}")
        recs = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    recs = [r for r in recs if "loss" in r]
    if [r["step"] for r in recs] != list(range(1, total + 1)):
        sys.exit(f"metrics.jsonl does not hold one record per step 1..{total}:\n{output}")
    per_step = {}  # rank -> {"wchar": bytes, "cpu_s": seconds} per step, over the sampled steps
    if "start" in samples and "end" in samples:
        (s0, c0), (s1, c1) = samples["start"], samples["end"]
        for r in c0:
            if c0[r] and c1.get(r) and s1 > s0:
                per_step[r] = {k: (c1[r][k] - c0[r][k]) / (s1 - s0) for k in ("wchar", "cpu_s")}
        per_step["steps_sampled"] = [s0, s1]
    return recs, output, per_step


def summarise(recs, warmup, tokens_per_step):
    kept = recs[warmup:]
    secs = [tokens_per_step / r["tokens_per_s"] for r in kept]
    return {"tokens_per_s": tokens_per_step * len(kept) / sum(secs),
            "median_ms_per_step": 1000 * statistics.median(secs), "steps_timed": len(kept),
            "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"]}


def check_log(output, nparams):
    """Rank 0's model line: exact parameter count and bucket count."""
    m = re.search(r"model gpt: (\d+) parameters.*?(\d+) buckets", output)
    if not m:
        sys.exit(f"no 'model gpt: N parameters ... N buckets' line in rank 0's output:\n{output}")
    logged = int(m.group(1))
    if logged != nparams:
        sys.exit(f"log says {logged} parameters, the model config gives {nparams}: update MODEL")
    return logged / 1e6, int(m.group(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"), help="the nnstrain binary")
    ap.add_argument("--steps", type=int, default=60, help="timed training steps per run")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    ap.add_argument("--global-batch", type=int, default=24, help="samples per step (dp=2: half per rank)")
    ap.add_argument("--repeats", type=int, default=1, help="alternate dp=1 and dp=2 this often; best kept")
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="reducer_bucket_cap_mb (default: the config's)")
    ap.add_argument("--data", default="data/shakespeare_char", help="folder with train.bin (nnstrain prepare)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the JSON and markdown go")
    a = ap.parse_args()
    if a.global_batch % 2:
        sys.exit("--global-batch must be even (dp=2 splits it)")
    binary = str(pathlib.Path(a.nnstrain).resolve())
    data_dir = (ROOT / a.data).resolve()
    if not (data_dir / "train.bin").is_file():
        sys.exit(f"{data_dir / 'train.bin'} not found: run `{binary} prepare shakespeare_char` first")

    T = MODEL["block_size"]
    tokens_per_step = a.global_batch * T
    nparams = gpt_parameters(**MODEL)
    grad_bytes = 4 * nparams
    layouts = {"dp1": (1, a.global_batch), "dp2": (2, a.global_batch // 2)}
    best, losses, extra = {}, {}, {}
    for rep in range(a.repeats):
        for name, (nproc, micro) in layouts.items():
            load_before = os.getloadavg()[0]
            recs, output, per_step = run(binary, nproc, micro, a.steps, a.warmup, data_dir, a.bucket_cap_mb)
            s = summarise(recs, a.warmup, tokens_per_step)
            s["load_avg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            s["per_step"] = per_step
            print(f"run {rep + 1}: {name} (micro {micro}) {s['tokens_per_s']:8.0f} tok/s, median "
                  f"{s['median_ms_per_step']:.1f} ms/step, loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}, "
                  f"load {s['load_avg_1min']}", flush=True)
            if nproc > 1:
                extra["logged_mparams"], extra["buckets"] = check_log(output, nparams)
            if name not in best or s["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = s
            losses[name] = [r["loss"] for r in recs]

    eff = best["dp2"]["tokens_per_s"] / (2 * best["dp1"]["tokens_per_s"])
    speedup = best["dp2"]["tokens_per_s"] / best["dp1"]["tokens_per_s"]
    loss_diff = max(abs(x - y) / abs(y) for x, y in zip(losses["dp2"], losses["dp1"]))
    n = 2
    ring = 2 * (n - 1) / n * grad_bytes
    for name, r in best.items():
        ranks = {k: v for k, v in r["per_step"].items() if isinstance(k, int)}
        cpu = sum(v["cpu_s"] for v in ranks.values())
        wall = tokens_per_step / r["tokens_per_s"]
        # CPU work per token, and how much of a core each process got (< 1: the machine was busy).
        r["tokens_per_cpu_s"] = tokens_per_step / cpu if cpu else None
        r["cpu_share_per_process"] = {k: v["cpu_s"] / wall for k, v in ranks.items()}
    cpu_eff = (best["dp2"]["tokens_per_cpu_s"] / best["dp1"]["tokens_per_cpu_s"]
               if best["dp1"]["tokens_per_cpu_s"] and best["dp2"]["tokens_per_cpu_s"] else None)
    per_step = best["dp2"]["per_step"]
    sent = {r: v["wchar"] for r, v in per_step.items() if isinstance(r, int)}
    print(f"parameters {nparams} ({extra['logged_mparams']}M logged), {extra['buckets']} buckets, "
          f"gradient bytes {grad_bytes}")
    print(f"scaling efficiency dp=2 / (2 x dp=1) = {eff:.3f} (speed-up {speedup:.3f}); CPU-time efficiency "
          f"(tokens per CPU second, dp=2 / dp=1) = {cpu_eff:.3f}; share of a core per process: "
          f"dp=1 {best['dp1']['cpu_share_per_process']}, dp=2 {best['dp2']['cpu_share_per_process']}")
    print(f"bytes written per step by each rank (measured) {sent}; "
          f"ring all-reduce theory 2(n-1)/n x gradient bytes = {ring:.0f}")
    print(f"largest relative loss difference dp=2 vs dp=1 over {len(losses['dp1'])} steps: {loss_diff:.2e}")

    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "bench_dp_cpu",
        "date": now.isoformat(timespec="seconds"),
        "device": cpu_model(), "logical_cpus": os.cpu_count(), "host": platform.node(),
        "torch": torch.__version__, "libtorch": libtorch_version(binary), "commit": git_commit(),
        "config": CONFIG, "model": MODEL, "parameters": nparams, "buckets": extra["buckets"],
        "bucket_cap_mb": a.bucket_cap_mb or "config default",
        "global_batch": a.global_batch, "seq_len": T, "tokens_per_step": tokens_per_step,
        "steps_timed": a.steps, "warmup_steps_excluded": a.warmup, "repeats": a.repeats,
        "threads_per_process": 1, "backend": "gloo",
        "results": best,
        "scaling_efficiency": eff, "speedup": speedup, "cpu_time_efficiency": cpu_eff,
        "gradient_bytes": grad_bytes, "ring_allreduce_bytes_per_rank_theory": ring,
        "measured_bytes_written_per_step_per_rank": sent,
        "max_rel_loss_diff_dp2_vs_dp1": loss_diff,
    }
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"dp_cpu_{now.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    d1, d2 = best["dp1"], best["dp2"]

    def share(d):
        return ", ".join(f"{v:.2f}" for _, v in sorted(d["cpu_share_per_process"].items()))
    lines = [
        f"# Data parallelism on CPU: nnstrain dp=2 vs dp=1 ({now.strftime('%Y-%m-%d %H:%M UTC')})", "",
        f"- device: {record['device']} ({record['logical_cpus']} logical CPUs), one thread per process, Gloo",
        f"- torch {record['torch']}, LibTorch (nnstrain) {record['libtorch']}, commit {record['commit']}",
        f"- model: {CONFIG} ({nparams} parameters, {extra['buckets']} bucket(s)), global batch "
        f"{a.global_batch} x {T} tokens (dp=1: micro {a.global_batch}, dp=2: micro {a.global_batch // 2} per rank), "
        f"{a.steps} steps timed after {a.warmup}, best of {a.repeats}",
        "",
        "| layout | tok/s | ms/step (median) | tokens per CPU second | share of a core per process | "
        "load avg (1 min, before/after) |",
        "|---|---:|---:|---:|---|---|",
        f"| dp=1 | {d1['tokens_per_s']:.0f} | {d1['median_ms_per_step']:.1f} | {d1['tokens_per_cpu_s']:.0f} | "
        f"{share(d1)} | {d1['load_avg_1min']} |",
        f"| dp=2 | {d2['tokens_per_s']:.0f} | {d2['median_ms_per_step']:.1f} | {d2['tokens_per_cpu_s']:.0f} | "
        f"{share(d2)} | {d2['load_avg_1min']} |",
        "",
        f"- scaling efficiency tok/s(dp=2) / (2 x tok/s(dp=1)) = **{eff:.3f}** (speed-up {speedup:.3f}); "
        "on a shared machine two processes get a larger share of the cores than one, so read it with "
        "the load average and the share of a core each process got",
        f"- CPU-time efficiency, tokens per CPU second dp=2 / dp=1 = **{cpu_eff:.3f}** (the work "
        "data parallelism adds per token: communication, smaller matrix products; less sensitive to load "
        "than wall time, though caches shared with other processes still move it)",
        f"- gradient bytes (parameters x 4) = {grad_bytes}; ring all-reduce theory 2(n-1)/n x that = "
        f"{ring:.0f} bytes per rank per step",
        f"- measured bytes written per rank per step (/proc/PID/io wchar, steps "
        f"{per_step.get('steps_sampled')}): " + ", ".join(f"rank {r}: {v:.0f}" for r, v in sorted(sent.items())),
        f"- largest relative loss difference dp=2 vs dp=1, all {len(losses['dp1'])} steps: {loss_diff:.2e}",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
