#!/usr/bin/env python3
"""PyTorch's own optimizer step on a GPT's parameter shapes: the baseline of
bench_optimizer_step_cpu.py and of the GPU battery's `muon` phase.

Parameters of nnstrain's GPT shapes (per block: attn.c_attn [3C, C] with q, k,
v fused, attn.c_proj [C, C], mlp.c_fc [4C, C], mlp.c_proj [C, 4C], two norm
weights; then wte [V, C] (tied with the head), wpe [T, C], ln_f; no biases),
random gradients, and two cases, each --warmup untimed then --steps timed
`step()` calls:

- adamw: torch.optim.AdamW(fused=True) over every parameter;
- muon:  torch.optim.Muon (its defaults but lr; it runs Newton-Schulz in bf16)
         over the block matrices + torch.optim.AdamW(fused=True) over the rest.

Time per step: wall time around the step calls (on CUDA with a synchronize
before and after); before them, timed apart, the gradients' global norm as a
training loop computes it for clipping or logging
(`torch.nn.utils.get_total_norm`, fp32, foreach), which nnstrain's
`time_optimizer_ms` also holds. Prints one JSON line per case: {"case", "ms":
[...], "norm_ms": [...], "params", "muon_params", "torch", "device"}.
"""
import argparse
import json
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as it is)")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024, help="rows of the position table")
    ap.add_argument("--lr", type=float, default=0.02, help="Muon's lr")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    C, L = a.n_embd, a.n_layer

    def param(*shape):
        t = torch.nn.Parameter(torch.randn(*shape, device=dev) * 0.02)
        t.grad = torch.randn(*shape, device=dev) * 1e-3
        return t

    mats = [param(*s) for _ in range(L) for s in ((3 * C, C), (C, C), (4 * C, C), (C, 4 * C))]
    rest = [param(a.vocab_size, C), param(a.seq, C)] + [param(C) for _ in range(2 * L + 1)]
    adamw = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    cases = {"adamw": lambda: [torch.optim.AdamW(mats + rest, **adamw)],
             "muon": lambda: [torch.optim.Muon(mats, lr=a.lr), torch.optim.AdamW(rest, **adamw)]}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    grads = [t.grad for t in mats + rest]
    for name, make in cases.items():
        opts, ms, norm_ms = make(), [], []
        for i in range(a.warmup + a.steps):
            sync()
            t0 = time.perf_counter()
            torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).item()
            t1 = time.perf_counter()
            for o in opts:
                o.step()
            sync()
            if i >= a.warmup:
                norm_ms.append((t1 - t0) * 1e3)
                ms.append((time.perf_counter() - t1) * 1e3)
        del opts
        print(json.dumps({"case": name, "ms": ms, "norm_ms": norm_ms, "params": sum(t.numel() for t in mats + rest),
                          "muon_params": sum(t.numel() for t in mats), "torch": torch.__version__,
                          "device": a.device}), flush=True)


if __name__ == "__main__":
    main()
