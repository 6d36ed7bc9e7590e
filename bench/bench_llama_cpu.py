#!/usr/bin/env python3
"""nnstrain against a plain PyTorch loop around transformers' LlamaForCausalLM, on CPU.

Trains configs/llama3_mini.yaml's model (4 layers, hidden 256, intermediate 704, 8 query /
4 key-value heads, rope_theta 1e4, RMSNorm eps 1e-5, tied embeddings, vocab 65; batch 8 x
128 tokens) for --steps steps, per thread count:

  (a) baseline: a fresh Python process (so its peak RSS is its own) that builds
      LlamaForCausalLM from the same LlamaConfig (attn_implementation="sdpa", float32,
      eager mode), draws random 128-token windows of the same train.bin, computes the
      cross entropy of all 128 positions against the inputs shifted by one (what nnstrain
      trains on; HF's labels= would drop one position), and steps
      torch.optim.AdamW(fused=True) with nnstrain's hyper-parameters and decay groups
      (weight decay on tensors of dim >= 2 only), cosine lr (warmup 100, decay 2000),
      clip_grad_norm_ 1.0; torch.set_num_threads(T);
  (b) nnstrain --config configs/llama3_mini.yaml --max_train_steps N with OMP_NUM_THREADS=T,
      optimizer.args.impl fused, a metrics record every step, no evaluation or checkpoints.

Timing: the first --warmup steps are dropped; tokens/s = tokens of the kept steps / their
time (nnstrain: sum of ms_per_step of its metrics records; Python: wall time of the kept
steps, each ending with loss.item()). The mean of nnstrain's per-record tokens_per_s is
also recorded.

Memory: peak RSS (VmHWM) of each process, and its startup RSS so the difference (what
training costs) can be compared: Python's VmRSS right after `import torch, transformers`;
nnstrain's peak RSS of `nnstrain --config ... --print-config` (loads the binary and its
libraries, parses the config, trains nothing), read from wait4()'s rusage.

Writes bench/results/llama3_mini_cpu.json and .md (device, date, torch version, git commit,
threads, load average before/after each measurement: other processes skew CPU timings).

Usage (repository root, after `nnstrain prepare shakespeare_char`):
  /root/.cache/nnstrain/venv/bin/python bench/bench_llama_cpu.py --nnstrain build/nnstrain --threads 1 2
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import cpu_model, git_commit  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/llama3_mini.yaml"

# configs/llama3_mini.yaml, restated for the baseline (check_config() compares).
LLAMA = dict(vocab_size=65, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
             rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02)
SEQ_LEN = 128
BATCH = 8
OPTIM = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0)
SCHED = dict(warmup=100, decay=2000, min_lr=1e-4)
SEED = 1337


def proc_status_kb(key, pid="self"):
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


# ---------------------------------------------------------------- the baseline (its own process)

def worker(train_bin, steps, warmup, threads):
    """Runs in a fresh process; prints one JSON line."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    startup_rss_mb = proc_status_kb("VmRSS") / 1024.0

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    cfg = LlamaConfig(**LLAMA, attention_bias=False, mlp_bias=False, use_cache=False,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).train()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the yaml
    n_params = sum(p.numel() for p in model.parameters())

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": OPTIM["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"], fused=True)

    def get_lr(it):  # nanoGPT's cosine, which nnstrain's scheduler reproduces
        lr, w, d, m = OPTIM["lr"], SCHED["warmup"], SCHED["decay"], SCHED["min_lr"]
        if it < w:
            return lr * (it + 1) / (w + 1)
        if it > d:
            return m
        return m + 0.5 * (1.0 + math.cos(math.pi * (it - w) / (d - w))) * (lr - m)

    data = np.memmap(train_bin, dtype=np.uint16, mode="r")

    def get_batch():
        ix = torch.randint(len(data) - SEQ_LEN, (BATCH,))
        x = torch.stack([torch.from_numpy(data[i:i + SEQ_LEN].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + SEQ_LEN].astype(np.int64)) for i in ix])
        return x, y

    losses = []
    t0 = None
    for it in range(steps):
        if it == warmup:
            t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = get_lr(it)
        x, y = get_batch()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the host read nnstrain does at each logged step
    elapsed = time.perf_counter() - t0
    kept = steps - warmup
    print(json.dumps({
        "tokens_per_s": kept * BATCH * SEQ_LEN / elapsed, "ms_per_step": 1000 * elapsed / kept,
        "steps_timed": kept, "loss_first": losses[0], "loss_last": losses[-1], "parameters": n_params,
        "startup_rss_mb": startup_rss_mb, "peak_rss_mb": proc_status_kb("VmHWM") / 1024.0,
        "torch": torch.__version__, "transformers": transformers.__version__}))


def run_baseline(train_bin, steps, warmup, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    p = subprocess.run([sys.executable, __file__, "--worker", "--data-file", str(train_bin), "--steps",
                        str(steps), "--warmup", str(warmup), "--threads", str(threads)],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"baseline worker failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- nnstrain

def run_peak_rss_mb(args, env):
    """Runs args; returns (exit status, stdout+stderr, child's peak RSS in MB from wait4)."""
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        return p.returncode, log.read(), ru.ru_maxrss / 1024.0  # ru_maxrss is in KiB on Linux


def nnstrain_env(threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_nnstrain(binary, steps, warmup, threads, data_dir):
    env = nnstrain_env(threads)
    rc, out, startup_mb = run_peak_rss_mb([binary, "--config", CONFIG, "--print-config",
                                           "--vars.data_dir", str(data_dir)], env)
    if rc != 0:
        sys.exit(f"nnstrain --print-config failed ({rc}):\n{out}")
    with tempfile.TemporaryDirectory(prefix="nnstrain_bench_") as tmp:
        args = [binary, "--config", CONFIG, "--run_dir", tmp, "--max_train_steps", str(steps),
                "--log_progress_every_n_train_steps", "1", "--val_every_n_train_steps", "0",
                "--checkpoint.save_dir=", "--checkpoint.every_n_train_steps", "0",
                "--checkpoint.keep_last_n_checkpoints", "0", "--optimizer.args.impl", "fused",
                "--vars.data_dir", str(data_dir)]
        rc, out, peak_mb = run_peak_rss_mb(args, env)
        if rc != 0:
            sys.exit(f"nnstrain failed ({rc}): {' '.join(args)}\n{out}")
        recs = [json.loads(l) for l in (pathlib.Path(tmp) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    recs = [r for r in recs if "loss" in r]
    if [r["step"] for r in recs] != list(range(1, steps + 1)):
        sys.exit(f"nnstrain metrics.jsonl does not hold one record per step 1..{steps}")
    kept = recs[warmup:]
    secs = sum(r["ms_per_step"] for r in kept) / 1000.0
    return {"tokens_per_s": len(kept) * BATCH * SEQ_LEN / secs, "ms_per_step": 1000 * secs / len(kept),
            "mean_of_record_tokens_per_s": sum(r["tokens_per_s"] for r in kept) / len(kept),
            "steps_timed": len(kept), "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"],
            "startup_rss_mb": startup_mb, "peak_rss_mb": peak_mb,  # wait4's (peak_mem_mb counts tensors only)
            "peak_tensor_mb": max(r.get("peak_tensor_mb", 0) for r in recs)}


def check_config(binary):
    """The baseline's constants must be the config's: compare with the resolved config."""
    p = subprocess.run([binary, "--config", CONFIG, "--print-config"], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"nnstrain --print-config failed: {p.stderr}")
    import re
    text = p.stdout

    def val(key):
        m = re.search(rf"^\s*{key}:\s*([^\s#]+)", text, re.M)
        return m.group(1) if m else None

    want = {**{k: v for k, v in LLAMA.items() if k != "tie_word_embeddings"},
            "micro_batch_size": BATCH, "seq_len": SEQ_LEN, "lr": OPTIM["lr"], "eps": OPTIM["eps"],
            "weight_decay": OPTIM["weight_decay"], "clip_gnorm": OPTIM["clip"],
            "warmup_steps": SCHED["warmup"], "decay_steps": SCHED["decay"], "min_lr": SCHED["min_lr"]}
    bad = {k: (val(k), v) for k, v in want.items() if val(k) is None or float(val(k)) != float(v)}
    if val("tie_word_embeddings") not in ("true", "True"):
        bad["tie_word_embeddings"] = (val("tie_word_embeddings"), True)
    if bad:
        sys.exit(f"{CONFIG} no longer matches this benchmark's baseline (key: (config, baseline)): {bad}")


# ---------------------------------------------------------------- reporting

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"), help="the nnstrain binary")
    ap.add_argument("--steps", type=int, default=40, help="training steps per measurement")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="thread counts to measure")
    ap.add_argument("--data", default="data/shakespeare_char", help="folder with train.bin (nnstrain prepare)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the JSON and markdown go")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data-file", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.steps <= a.warmup:
        sys.exit("--steps must exceed --warmup")
    if a.worker:
        worker(a.data_file, a.steps, a.warmup, a.threads[0])
        return
    binary = str(pathlib.Path(a.nnstrain).resolve())
    data_dir = (ROOT / a.data).resolve()
    train_bin = data_dir / "train.bin"
    if not train_bin.is_file():
        sys.exit(f"{train_bin} not found: run `{binary} prepare shakespeare_char` first")
    check_config(binary)

    results, versions = [], {}
    for threads in a.threads:
        row = {"threads": threads}
        for name, fn in (("pytorch_hf_llama", lambda: run_baseline(train_bin, a.steps, a.warmup, threads)),
                         ("nnstrain", lambda: run_nnstrain(binary, a.steps, a.warmup, threads, data_dir))):
            load_before = os.getloadavg()[0]
            s = fn()
            s["load_avg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            for k in ("torch", "transformers", "parameters"):
                if k in s:
                    versions[k] = s.pop(k)
            print(f"threads {threads}: {name:16s} {s['tokens_per_s']:8.0f} tok/s, {s['ms_per_step']:.1f} ms/step, "
                  f"startup RSS {s['startup_rss_mb']:.0f} MB, peak RSS {s['peak_rss_mb']:.0f} MB, loss "
                  f"{s['loss_first']:.3f} -> {s['loss_last']:.3f}, load {s['load_avg_1min']}", flush=True)
            row[name] = s
        row["ratio_nnstrain_over_pytorch"] = row["nnstrain"]["tokens_per_s"] / row["pytorch_hf_llama"]["tokens_per_s"]
        print(f"threads {threads}: nnstrain / PyTorch = {row['ratio_nnstrain_over_pytorch']:.3f}", flush=True)
        results.append(row)

    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "bench_llama_cpu", "date": now.isoformat(timespec="seconds"),
        "device": cpu_model(), "logical_cpus": os.cpu_count(), "host": platform.node(),
        **versions, "commit": git_commit(), "config": CONFIG, "llama_config": LLAMA,
        "batch": BATCH, "seq_len": SEQ_LEN, "steps": a.steps, "warmup_steps_excluded": a.warmup,
        "results": results,
    }
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / "llama3_mini_cpu"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# llama3_mini training on CPU: nnstrain vs PyTorch + transformers LlamaForCausalLM", "",
        f"- date: {now.strftime('%Y-%m-%d %H:%M UTC')}; commit {record['commit']}",
        f"- device: {record['device']} ({record['logical_cpus']} logical CPUs, shared with other builds: "
        "see the load averages)",
        f"- torch {versions.get('torch')}, transformers {versions.get('transformers')} (nnstrain links the same "
        "wheel's LibTorch)",
        f"- model: {CONFIG} ({versions.get('parameters')} parameters), batch {BATCH} x {SEQ_LEN} tokens, "
        f"AdamW fused, {a.steps} steps, first {a.warmup} not timed; eager, sdpa attention, float32",
        "- memory: startup RSS = Python after `import torch, transformers` / nnstrain running "
        "`--print-config`; peak = VmHWM of the training process",
        "", "| threads | nnstrain tok/s | PyTorch tok/s | ratio | nnstrain ms/step | PyTorch ms/step | "
            "nnstrain RSS startup / peak (MB) | PyTorch RSS startup / peak (MB) | load avg 1 min (before/after) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        n, p = r["nnstrain"], r["pytorch_hf_llama"]
        lines.append(f"| {r['threads']} | {n['tokens_per_s']:.0f} | {p['tokens_per_s']:.0f} | "
                     f"{r['ratio_nnstrain_over_pytorch']:.3f} | {n['ms_per_step']:.1f} | {p['ms_per_step']:.1f} | "
                     f"{n['startup_rss_mb']:.0f} / {n['peak_rss_mb']:.0f} | "
                     f"{p['startup_rss_mb']:.0f} / {p['peak_rss_mb']:.0f} | "
                     f"nnstrain {n['load_avg_1min']}, PyTorch {p['load_avg_1min']} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
