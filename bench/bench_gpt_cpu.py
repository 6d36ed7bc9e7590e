#!/usr/bin/env python3
"""nnstrain against a plain PyTorch training loop on CPU (eager and torch.compile), same model, same run.

Trains the CPU variant of nanoGPT's shakespeare_char GPT (configs/shakespeare_char_cpu.yaml:
n_layer 4, n_head 4, n_embd 128, block 64, batch 12, no bias, dropout 0, AdamW fused,
cosine lr, clip 1.0) for --steps steps twice per thread count:

  (a) baseline: the nanoGPT-style eager PyTorch loop in this file (token + position
      embeddings, pre-LN blocks, F.scaled_dot_product_attention causal, GELU MLP, tied
      head, nanoGPT's init and get_lr, torch.optim.AdamW(fused=True) with nanoGPT's two
      weight-decay groups, clip_grad_norm_), random windows of the same train.bin,
      torch.set_num_threads(N);
  (a') the same loop with the model under torch.compile (default mode, inductor's
      C++ backend; the compile happens in the untimed warm-up steps);
  (b) nnstrain --config configs/shakespeare_char_cpu.yaml --max_train_steps N, with
      OMP_NUM_THREADS=N, a metrics record every step, no evaluation, no checkpoints.

Both are timed the same way: wall time from the end of one step (its loss read on the
host) to the end of the next; the first --warmup steps are dropped. For nnstrain these
are the per-step tokens_per_s of its metrics.jsonl. Reported: tokens/s = tokens of the
kept steps / their summed time; tokens/s at the median step time (robust to steps that
other processes stalled); the slowest step; and both ratios nnstrain / baseline. With
--repeats, the repeat with the best median is kept.

Writes bench/results/gpt_cpu_<UTC time>.json and .md with the device (CPU model),
date, torch and LibTorch versions, git commit, threads and the load average around
each measurement (other processes on the machine skew CPU timings: note it).

Usage (from the repository root, after `nnstrain prepare shakespeare_char`):
  /root/.cache/nnstrain/venv/bin/python bench/bench_gpt_cpu.py --nnstrain build/nnstrain --threads 1 2
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import cpu_model, git_commit, libtorch_version, run_single  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/shakespeare_char_cpu.yaml"

# configs/shakespeare_char_cpu.yaml, restated for the baseline (check_config() compares).
MODEL = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False)
BATCH = 12
OPTIM = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, clip=1.0)
SCHED = dict(warmup=100, decay=2000, min_lr=1e-4)
SEED = 1337


# ---------------------------------------------------------------- the baseline (nanoGPT's model.py, trimmed)

class SelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = SelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias):
        super().__init__()
        assert dropout == 0.0
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_lr(it):  # nanoGPT's
    lr, warmup, decay, min_lr = OPTIM["lr"], SCHED["warmup"], SCHED["decay"], SCHED["min_lr"]
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (decay - warmup)))
    return min_lr + coeff * (lr - min_lr)


def run_baseline(train_bin, steps, threads, compiled=False):
    """Per-step seconds and losses of the PyTorch loop, eager or under torch.compile."""
    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    data = np.memmap(train_bin, dtype=np.uint16, mode="r")
    T = MODEL["block_size"]

    def get_batch():  # nanoGPT's get_batch on CPU
        ix = torch.randint(len(data) - T, (BATCH,))
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    model = GPT(**MODEL).train()
    params = [p for p in model.parameters() if p.requires_grad]
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": OPTIM["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"], fused=True)
    secs, losses = [], []
    t_prev = time.perf_counter()
    for it in range(steps):
        for g in opt.param_groups:
            g["lr"] = get_lr(it)
        x, y = get_batch()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the host read nnstrain does at each logging step
        now = time.perf_counter()
        secs.append(now - t_prev)
        t_prev = now
    return secs, losses


# ---------------------------------------------------------------- nnstrain

def nnstrain_step_times(binary, steps, threads, data_dir):
    """Per-step seconds (from metrics.jsonl tokens_per_s) and losses of nnstrain."""
    tokens_per_step = BATCH * MODEL["block_size"]
    with tempfile.TemporaryDirectory(prefix="nnstrain_bench_") as tmp:
        args = [binary, "--config", CONFIG, "--run_dir", tmp, "--max_train_steps", str(steps),
                "--log_progress_every_n_train_steps", "1", "--val_every_n_train_steps", "0",
                "--checkpoint.save_dir=", "--checkpoint.every_n_train_steps", "0",
                "--checkpoint.keep_last_n_checkpoints", "0", "--optimizer.args.impl", "fused",
                "--vars.data_dir", str(data_dir)]
        run_single(args, threads)
        recs = [json.loads(l) for l in (pathlib.Path(tmp) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    recs = [r for r in recs if "loss" in r]
    if [r["step"] for r in recs] != list(range(1, steps + 1)):
        sys.exit(f"nnstrain metrics.jsonl does not hold one record per step 1..{steps}")
    return [tokens_per_step / r["tokens_per_s"] for r in recs], [r["loss"] for r in recs]


def check_config(binary):
    """The baseline's constants must be the config's: read the resolved config."""
    p = subprocess.run([binary, "--config", CONFIG, "--print-config"], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"nnstrain --print-config failed: {p.stderr}")
    text = p.stdout

    def val(key):
        m = re.search(rf"^\s*{key}:\s*([^\s#]+)", text, re.M)
        return m.group(1) if m else None

    want = {"n_layer": MODEL["n_layer"], "n_head": MODEL["n_head"], "n_embd": MODEL["n_embd"],
            "vocab_size": MODEL["vocab_size"], "micro_batch_size": BATCH, "seq_len": MODEL["block_size"],
            "warmup_steps": SCHED["warmup"], "decay_steps": SCHED["decay"]}
    bad = {k: (val(k), v) for k, v in want.items() if val(k) is None or int(float(val(k))) != v}
    if val("bias") not in ("false", "False") or float(val("dropout")) != 0.0:
        bad["bias/dropout"] = (val("bias"), val("dropout"))
    if bad:
        sys.exit(f"{CONFIG} no longer matches this benchmark's baseline (key: (config, baseline)): {bad}")


# ---------------------------------------------------------------- reporting

def summarise(secs, losses, warmup):
    kept = secs[warmup:]
    per_step = BATCH * MODEL["block_size"]
    median = statistics.median(kept)
    # The median resists steps stalled by other processes (an OpenMP team waits for
    # its slowest thread); the mean is what a whole run would see.
    return {"tokens_per_s": per_step * len(kept) / sum(kept), "tokens_per_s_median": per_step / median,
            "median_ms_per_step": 1000 * median, "max_ms_per_step": 1000 * max(kept),
            "steps_timed": len(kept), "loss_first": losses[0], "loss_last": losses[-1]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"), help="the nnstrain binary")
    ap.add_argument("--steps", type=int, default=200, help="training steps per measurement")
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out of the timing")
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="thread counts to measure")
    ap.add_argument("--repeats", type=int, default=1, help="alternate baseline and nnstrain this often; the best median is kept")
    ap.add_argument("--data", default="data/shakespeare_char", help="folder with train.bin (nnstrain prepare)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the JSON and markdown go")
    ap.add_argument("--note", default="", help="a remark stored with the results (e.g. what else ran)")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        sys.exit("--steps must exceed --warmup")
    binary = str(pathlib.Path(a.nnstrain).resolve())
    data_dir = (ROOT / a.data).resolve()
    train_bin = data_dir / "train.bin"
    if not train_bin.is_file():
        sys.exit(f"{train_bin} not found: run `{binary} prepare shakespeare_char` first")
    check_config(binary)

    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "bench_gpt_cpu",
        "date": now.isoformat(timespec="seconds"),
        "device": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "host": platform.node(),
        "torch": torch.__version__,
        "libtorch": libtorch_version(binary),
        "commit": git_commit(),
        "config": CONFIG,
        "model": MODEL, "batch": BATCH,
        "steps": a.steps, "warmup_steps_excluded": a.warmup, "repeats": a.repeats,
        "tokens_per_step": BATCH * MODEL["block_size"],
        "note": a.note,
        "results": [],
    }
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpt_cpu_{now.strftime('%Y%m%d-%H%M%S')}"

    for threads in a.threads:
        best = {}
        for rep in range(a.repeats):
            for name, fn in (("pytorch_eager", lambda: run_baseline(train_bin, a.steps, threads)),
                             ("pytorch_compile", lambda: run_baseline(train_bin, a.steps, threads, compiled=True)),
                             ("nnstrain", lambda: nnstrain_step_times(binary, a.steps, threads, data_dir))):
                load_before = os.getloadavg()[0]
                secs, losses = fn()
                s = summarise(secs, losses, a.warmup)
                s["load_avg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
                print(f"threads {threads}, run {rep + 1}: {name:14s} {s['tokens_per_s']:7.0f} tok/s "
                      f"(median step: {s['tokens_per_s_median']:7.0f}), median {s['median_ms_per_step']:.1f} "
                      f"ms/step, max {s['max_ms_per_step']:.0f}, loss {s['loss_first']:.3f} -> "
                      f"{s['loss_last']:.3f}, load {s['load_avg_1min']}", flush=True)
                if name not in best or s["tokens_per_s_median"] > best[name]["tokens_per_s_median"]:
                    best[name] = s
        entry = {"threads": threads, **best}
        for base in BASELINES:
            ratio = best["nnstrain"]["tokens_per_s"] / best[base]["tokens_per_s"]
            ratio_median = best["nnstrain"]["tokens_per_s_median"] / best[base]["tokens_per_s_median"]
            print(f"threads {threads}: nnstrain / {base} = {ratio:.3f} (mean), {ratio_median:.3f} (median step)",
                  flush=True)
            entry[f"ratio_nnstrain_over_{base}"] = ratio
            entry[f"ratio_nnstrain_over_{base}_median"] = ratio_median
        record["results"].append(entry)
        write_results(stem, record, a)  # after every thread count, so an interrupted run keeps what it measured
    print(f"wrote {stem}.json and {stem}.md")


BASELINES = ("pytorch_eager", "pytorch_compile")


def write_results(stem, record, a):
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"# GPT training on CPU: nnstrain vs PyTorch eager and torch.compile ({record['date']})", "",
        f"- device: {record['device']} ({record['logical_cpus']} logical CPUs)",
        f"- torch (baseline) {record['torch']}, LibTorch (nnstrain) {record['libtorch']}",
        f"- commit {record['commit']}",
        f"- model: {CONFIG} (n_layer {MODEL['n_layer']}, n_head {MODEL['n_head']}, n_embd {MODEL['n_embd']}, "
        f"block {MODEL['block_size']}, batch {BATCH}), {a.steps} steps, first {a.warmup} not timed, "
        f"best median of {a.repeats}",
    ]
    if record["note"]:
        lines.append(f"- note: {record['note']}")
    lines += [
        "", "tok/s = tokens of the timed steps / their time; median = tokens per step / median step time "
            "(robust to steps stalled by other processes). Ratio > 1: nnstrain faster.",
        "", "| threads | baseline | nnstrain tok/s | baseline tok/s | ratio | nnstrain tok/s (median) | "
            "baseline tok/s (median) | ratio (median) | max ms/step nnstrain / baseline | "
            "load avg (1 min, before/after) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in record["results"]:
        n = r["nnstrain"]
        for base in BASELINES:
            p = r[base]
            lines.append(f"| {r['threads']} | {base} (fused AdamW) | {n['tokens_per_s']:.0f} | {p['tokens_per_s']:.0f} | "
                         f"{r[f'ratio_nnstrain_over_{base}']:.3f} | {n['tokens_per_s_median']:.0f} | "
                         f"{p['tokens_per_s_median']:.0f} | {r[f'ratio_nnstrain_over_{base}_median']:.3f} | "
                         f"{n['max_ms_per_step']:.0f} / {p['max_ms_per_step']:.0f} | "
                         f"nnstrain {n['load_avg_1min']}, {base} {p['load_avg_1min']} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
