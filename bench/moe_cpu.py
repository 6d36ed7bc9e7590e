#!/usr/bin/env python3
"""nnstrain's moe_mini (configs/moe_mini.yaml) against a PyTorch eager reference of the
same model written here, on CPU, tokens/s per thread count.

The reference is Qwen3-MoE as configs/moe_mini.yaml states it (4 layers, hidden 128, 4
query / 2 key-value heads of 32 with per-head QK RMSNorm, rotary, 16 SwiGLU experts of width
128, top-2 softmax renormalised, tied embeddings, vocabulary 65; batch 8 x 128), written
with torch.nn modules, its experts run four ways (REFERENCES below): a per-expert loop over
stacked weights, the same loop over one parameter per expert, torch._grouped_mm, and a
zero-padded bmm. The goal (issue 38) is nnstrain at or above the fastest.
Each steps torch.optim.AdamW(fused=True) on random windows of train.bin with clipping
1.0 (the balancing loss of the config included: coef 0.01 x E sum f P over the batch).
nnstrain runs the config with --max_train_steps N at OMP_NUM_THREADS=T. The first
--warmup steps are not timed (nnstrain: its metrics' ms_per_step; Python: wall time).

Writes bench/results/moe_cpu_<date>.json and .md (device, date, LibTorch, commit, load).
Usage (repository root, after `nnstrain prepare shakespeare_char`):
  ~/.cache/nnstrain/venv/bin/python bench/moe_cpu.py --nnstrain build/nnstrain --threads 1 2
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import cpu_model, git_commit, libtorch_version  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/moe_mini.yaml"
M = dict(vocab=65, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, experts=16, top_k=2, inter=128,
         theta=10000.0, eps=1e-6, aux=0.01)
SEQ, BATCH = 128, 8
REFERENCES = ["loop", "modules", "grouped_mm", "padded"]
REFERENCE_TEXT = {
    "loop": "one matmul per expert on its rows, the experts' weights stacked [E, N, K] (w[e])",
    "modules": "the same loop over one parameter per expert (Mixtral's nn.ModuleList form)",
    "grouped_mm": "torch._grouped_mm over the stacked weights (its CPU path)",
    "padded": "the rows zero-padded into [E, max rows, C], one bmm per projection",
}
OPT = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def worker(train_bin, steps, warmup, threads, impl):
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    torch.manual_seed(1337)
    C, E, K, I = M["hidden"], M["experts"], M["top_k"], M["inter"]

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + M["eps"]) * self.weight

    def rope(t, cos, sin):
        h = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., h:], t[..., :h]), -1) * sin

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            d, hq, hk = M["head_dim"], M["heads"], M["kv_heads"]
            self.q, self.k = nn.Linear(C, hq * d, bias=False), nn.Linear(C, hk * d, bias=False)
            self.v, self.o = nn.Linear(C, hk * d, bias=False), nn.Linear(hq * d, C, bias=False)
            self.qn, self.kn = RMSNorm(d), RMSNorm(d)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            d = M["head_dim"]
            q = rope(self.qn(self.q(x).view(B, T, -1, d)).transpose(1, 2), cos, sin)
            k = rope(self.kn(self.k(x).view(B, T, -1, d)).transpose(1, 2), cos, sin)
            v = self.v(x).view(B, T, -1, d).transpose(1, 2)
            rep = M["heads"] // M["kv_heads"]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(B, T, -1))

    def grouped(x, w, counts):  # rows sorted by expert x each expert's w^T
        if impl in ("loop", "modules"):  # w: the stacked [E, N, K] or a list of E [N, K] parameters
            return torch.cat([x_e @ w[e].t() for e, x_e in enumerate(torch.split(x, counts)) if counts[e]])
        if impl == "grouped_mm":
            offs = torch.tensor(counts).cumsum(0).to(torch.int32)
            return torch._grouped_mm(x, w.transpose(1, 2), offs)
        most = max(counts)
        slot = torch.cat([torch.arange(c) + e * most for e, c in enumerate(counts)])
        batch = x.new_zeros(E * most, x.shape[1]).index_copy(0, slot, x).view(E, most, -1)
        return torch.bmm(batch, w.transpose(1, 2)).reshape(E * most, -1).index_select(0, slot)

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(C, E, bias=False)
            if impl == "modules":  # one parameter per expert and projection, as Mixtral's nn.ModuleList
                self.w_gate = nn.ParameterList(nn.Parameter(0.02 * torch.randn(I, C)) for _ in range(E))
                self.w_up = nn.ParameterList(nn.Parameter(0.02 * torch.randn(I, C)) for _ in range(E))
                self.w_down = nn.ParameterList(nn.Parameter(0.02 * torch.randn(C, I)) for _ in range(E))
            else:
                self.w_gate = nn.Parameter(0.02 * torch.randn(E, I, C))
                self.w_up = nn.Parameter(0.02 * torch.randn(E, I, C))
                self.w_down = nn.Parameter(0.02 * torch.randn(E, C, I))

        def forward(self, x):
            B, T, _ = x.shape
            flat = x.reshape(-1, C)
            probs = self.gate(flat).float().softmax(-1)
            w, idx = probs.topk(K, -1)
            w = w / w.sum(-1, keepdim=True)
            order = idx.reshape(-1).argsort(stable=True)
            counts = torch.bincount(idx.reshape(-1), minlength=E).tolist()
            rows = flat.index_select(0, order // K)
            h = F.silu(grouped(rows, self.w_gate, counts)) * grouped(rows, self.w_up, counts)
            out = torch.empty_like(rows).index_copy(0, order, grouped(h, self.w_down, counts))
            y = (out.view(-1, K, C) * w.unsqueeze(-1)).sum(1)
            f = torch.zeros(E).index_add_(0, idx.reshape(-1), torch.ones(idx.numel())) / flat.shape[0]
            aux = M["aux"] * E * (f * probs.mean(0)).sum()
            return y.view(B, T, C), aux

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2, self.attn, self.moe = RMSNorm(C), RMSNorm(C), Attention(), Moe()

        def forward(self, x, cos, sin):
            x = x + self.attn(self.n1(x), cos, sin)
            y, aux = self.moe(self.n2(x))
            return x + y, aux

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(M["vocab"], C)
            self.layers = nn.ModuleList(Layer() for _ in range(M["layers"]))
            self.norm = RMSNorm(C)

        def forward(self, idx):
            d = M["head_dim"]
            inv = 1.0 / (M["theta"] ** (torch.arange(0, d, 2).float() / d))
            f = torch.arange(idx.shape[1]).float()[:, None] * inv
            emb = torch.cat((f, f), -1)
            cos, sin = emb.cos(), emb.sin()
            x, aux = self.emb(idx), 0.0
            for l in self.layers:
                x, a = l(x, cos, sin)
                aux = aux + a
            return self.norm(x) @ self.emb.weight.t(), aux

    model = Model().train()
    with torch.no_grad():  # nnstrain's (and transformers') init: N(0, 0.02) matrices, unit norms
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": OPT["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"], fused=True)
    data = np.memmap(train_bin, dtype=np.uint16, mode="r")
    losses, t0 = [], None
    for it in range(steps):
        if it == warmup:
            t0 = time.perf_counter()
        ix = torch.randint(len(data) - SEQ, (BATCH,))
        x = torch.stack([torch.from_numpy(data[i:i + SEQ].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + SEQ].astype(np.int64)) for i in ix])
        logits, aux = model(x)
        loss = F.cross_entropy(logits.view(-1, M["vocab"]), y.view(-1))
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    elapsed = time.perf_counter() - t0
    kept = steps - warmup
    print(json.dumps({"tokens_per_s": kept * BATCH * SEQ / elapsed, "ms_per_step": 1000 * elapsed / kept,
                      "loss_first": losses[0], "loss_last": losses[-1], "torch": torch.__version__}))


def run_reference(train_bin, steps, warmup, threads, impl):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    p = subprocess.run([sys.executable, __file__, "--worker", impl, "--data-file", str(train_bin), "--steps",
                        str(steps), "--warmup", str(warmup), "--threads", str(threads)],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"reference ({impl}) failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_nnstrain(binary, steps, warmup, threads, data_dir):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory(prefix="nnstrain_moe_bench_") as tmp:
        args = [binary, "--config", CONFIG, "--run_dir", tmp, "--max_train_steps", str(steps),
                "--log_progress_every_n_train_steps", "1", "--val_every_n_train_steps", "0",
                "--checkpoint.save_dir=", "--checkpoint.every_n_train_steps", "0",
                "--checkpoint.keep_last_n_checkpoints", "0", "--optimizer.args.impl", "fused",
                "--vars.data_dir", str(data_dir)]
        p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"nnstrain failed ({p.returncode}): {' '.join(args)}\n{p.stdout}{p.stderr}")
        recs = [json.loads(l) for l in (pathlib.Path(tmp) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    recs = [r for r in recs if "loss" in r and "ms_per_step" in r]
    kept = recs[warmup:]
    secs = sum(r["ms_per_step"] for r in kept) / 1000.0
    return {"tokens_per_s": len(kept) * BATCH * SEQ / secs, "ms_per_step": 1000 * secs / len(kept),
            "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nnstrain", default="build/nnstrain")
    ap.add_argument("--data-dir", default="data/shakespeare_char")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker")
    ap.add_argument("--data-file")
    args = ap.parse_args()
    if args.worker:
        return worker(args.data_file, args.steps, args.warmup, args.threads[0], args.worker)
    train_bin = pathlib.Path(args.data_dir) / "train.bin"
    rows = []
    for t in args.threads:
        row = {"threads": t, "load_before": os.getloadavg()[0]}
        runs = {name: [] for name in ["nnstrain"] + REFERENCES}
        for _ in range(args.repeats):  # interleaved, so a busy spell on the shared machine hits all alike
            runs["nnstrain"].append(run_nnstrain(args.nnstrain, args.steps, args.warmup, t, args.data_dir))
            for impl in REFERENCES:
                runs[impl].append(run_reference(train_bin, args.steps, args.warmup, t, impl))
        for name, rs in runs.items():  # the median run by tokens/s, the others kept
            rs = sorted(rs, key=lambda r: r["tokens_per_s"])
            row[name] = dict(rs[len(rs) // 2], all_tokens_per_s=[round(r["tokens_per_s"]) for r in rs])
        row["load_after"] = os.getloadavg()[0]
        row["fastest_reference"] = max(REFERENCES, key=lambda i: row[i]["tokens_per_s"])
        row["ratio_to_fastest_reference"] = row["nnstrain"]["tokens_per_s"] / row[row["fastest_reference"]]["tokens_per_s"]
        print(f"threads {t}: nnstrain {row['nnstrain']['tokens_per_s']:.0f} tok/s, "
              + ", ".join(f"{i} {row[i]['tokens_per_s']:.0f}" for i in REFERENCES)
              + f", ratio to {row['fastest_reference']} {row['ratio_to_fastest_reference']:.3f}", flush=True)
        rows.append(row)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(), "device": cpu_model(),
            "cpus": os.cpu_count(), "libtorch": libtorch_version(args.nnstrain), "steps": args.steps,
            "warmup": args.warmup, "repeats": args.repeats, "batch": [BATCH, SEQ], "rows": rows}
    out = ROOT / "bench" / "results" / f"moe_cpu_{now.strftime('%Y%m%d-%H%M%S')}"
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    md = ["# moe_mini training on CPU: nnstrain vs PyTorch eager references of the same model", "",
          f"- date: {meta['date']}; commit {meta['commit']}",
          f"- device: {meta['device']} ({meta['cpus']} logical CPUs, shared: see the load averages)",
          f"- LibTorch {meta['libtorch']}; batch {BATCH} x {SEQ}; {args.steps} steps, first {args.warmup} not timed; "
          f"median of {args.repeats} interleaved runs each",
          "- references: " + "; ".join(f"{i}: {REFERENCE_TEXT[i]}" for i in REFERENCES),
          "", "| threads | nnstrain tok/s | " + " | ".join(f"{i} tok/s" for i in REFERENCES)
          + " | nnstrain / fastest | load 1 min before/after |",
          "|---:|---:|" + "---:|" * len(REFERENCES) + "---:|---|"]
    for r in rows:
        md.append(f"| {r['threads']} | {r['nnstrain']['tokens_per_s']:.0f} | "
                  + " | ".join(f"{r[i]['tokens_per_s']:.0f}" for i in REFERENCES)
                  + f" | {r['ratio_to_fastest_reference']:.3f} ({r['fastest_reference']}) | "
                  f"{r['load_before']:.2f} / {r['load_after']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(out.with_suffix(".md"))


if __name__ == "__main__":
    main()
